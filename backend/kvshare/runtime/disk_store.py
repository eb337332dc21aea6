"""DiskStore: one file per KV page in a directory, written atomically, checksummed when read back.

    <dir>/<layout fingerprint>/<page key hex>.kvpage
    file = MAGIC (8) | meta length (u32 LE) | meta (JSON) | digest (16) | body
    meta = {"fingerprint", "key", "parent", "salt", "tokens", "body"}        body = the page's tensors
    digest = SHA-256(meta + body), first 16 bytes

The layout fingerprint names the model, the KV dtype, the page size and every page tensor's shape
and dtype (KVCache.page_tensors), so a file written for another layout is never read as this one's:
it lives in another subdirectory, and its header is checked again on every read. A file is written
to a temporary name and renamed (a crash leaves a *.tmp, which scan() deletes, never a torn page);
a read whose digest, length or header does not match is a miss (DiskTier.read_done(ok=False)).
SHA-256 because OpenSSL runs it on the CPU's SHA instructions: on the 2-core CPU machine (loaded)
it hashed 8 MiB (one Llama-2-7B fp16 page of 16 tokens) in 19 ms, blake2b in 53 ms, CRC-32 in 14 ms.
Not fsynced: the tier survives a process restart; after a power loss the checksum turns a torn page
into a miss. Bytes go through KvikIO (kvikio.CuFile, its thread pool, POSIX or GPUDirect Storage)
when it is importable and usable, else through os.pwrite / os.preadv.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("kvshare.runtime")

MAGIC = b"KVSPAGE1"
SUFFIX = ".kvpage"
_DIGEST = 16
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class PageHeader:
    """What a page file says about its page (the engine indexes it as core's IndexedPage)."""
    key: bytes
    parent_key: bytes
    salt: bytes
    tokens: tuple[int, ...]


def layout_fingerprint(model: str, model_config: object, page_tensors: Sequence[torch.Tensor], page_size: int,
                       key_scheme: str, extra: str = "") -> str:
    """A short hex name of everything that must match for a file's bytes to be this pool's KV."""
    parts = [f"model={model}", f"config={model_config!r}", f"page_size={page_size}", f"keys={key_scheme}", extra]
    path = Path(model) if model and not model.startswith("dummy:") else None
    if path is not None and path.exists():       # the same name with other weights is another model
        stat = path.stat()
        parts.append(f"weights={stat.st_size}:{stat.st_mtime_ns}")
    parts += [f"{tuple(t.shape[1:])}:{t.dtype}" for t in page_tensors]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


def _kvikio():
    try:
        import kvikio  # type: ignore[import-not-found]
    except Exception:        # not installed, or its CUDA libraries are missing
        return None
    return kvikio


def _bytes_of(t: torch.Tensor):
    """A writable byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class DiskStore:
    def __init__(self, root: str | os.PathLike, fingerprint: str, *, use_kvikio: bool | None = None):
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        kvikio = _kvikio() if use_kvikio is not False else None
        self._kvikio = kvikio if kvikio is not None and _kvikio_works(kvikio, self.dir) else None
        if use_kvikio and self._kvikio is None:
            log.warning("disk tier: KvikIO requested but not usable here; POSIX I/O")

    @property
    def io_library(self) -> str:
        return "kvikio" if self._kvikio is not None else "posix"

    def path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def _meta(self, key: bytes, parent_key: bytes, salt: bytes, tokens: Sequence[int], body: int) -> bytes:
        return json.dumps({"fingerprint": self.fingerprint, "key": key.hex(), "parent": parent_key.hex(),
                           "salt": salt.hex(), "tokens": list(tokens), "body": body},
                          separators=(",", ":")).encode()

    def write(self, key: bytes, parent_key: bytes, salt: bytes, tokens: Sequence[int],
              tensors: Sequence[torch.Tensor]) -> None:
        """Write one page (one slot of each host page tensor) to its file, atomically."""
        views = [_bytes_of(t) for t in tensors]
        body = sum(v.nbytes for v in views)
        meta = self._meta(key, parent_key, salt, tokens, body)
        digest = hashlib.sha256(meta)
        for v in views:
            digest.update(v)              # hashlib releases the GIL on large buffers
        head = MAGIC + _LEN.pack(len(meta)) + meta + digest.digest()[:_DIGEST]
        final = self.path(key)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")
        self._write_file(tmp, head, views)
        os.replace(tmp, final)

    def read_into(self, key: bytes, tensors: Sequence[torch.Tensor]) -> bool:
        """Read key's page into one slot of each host page tensor; False (slot contents undefined)
        if the file is missing, torn, of another layout or page, or fails its checksum."""
        try:
            with open(self.path(key), "rb") as f:
                head = f.read(len(MAGIC) + _LEN.size)
                if len(head) != len(MAGIC) + _LEN.size or head[:len(MAGIC)] != MAGIC:
                    return False
                (meta_len,) = _LEN.unpack(head[len(MAGIC):])
                meta = f.read(meta_len)
                info = json.loads(meta)
                views = [_bytes_of(t) for t in tensors]
                if (info.get("fingerprint") != self.fingerprint or info.get("key") != key.hex()
                        or info.get("body") != sum(v.nbytes for v in views)):
                    return False
                want = f.read(_DIGEST)
                offset = len(head) + meta_len + _DIGEST
                if os.fstat(f.fileno()).st_size != offset + info["body"]:
                    return False                              # truncated, or longer than a page
                if self._read_body(f, offset, views) != info["body"]:
                    return False
        except (OSError, ValueError, KeyError):
            return False
        digest = hashlib.sha256(meta)
        for v in views:
            digest.update(v)
        return digest.digest()[:_DIGEST] == want

    def delete(self, key: bytes) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass

    def scan(self) -> list[PageHeader]:
        """The pages in the directory, oldest first (by modification time), read from their headers;
        leftover temporary files and unreadable headers are deleted. Bodies are checked on read."""
        found: list[tuple[int, PageHeader]] = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".tmp"):
                _unlink(entry.path)
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            page = self._header(entry.path)
            if page is None or page.key.hex() + SUFFIX != entry.name:
                _unlink(entry.path)
                continue
            found.append((entry.stat().st_mtime_ns, page))
        found.sort(key=lambda item: item[0])
        return [page for _, page in found]

    def _header(self, path: str) -> PageHeader | None:
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + _LEN.size)
                if len(head) != len(MAGIC) + _LEN.size or head[:len(MAGIC)] != MAGIC:
                    return None
                (meta_len,) = _LEN.unpack(head[len(MAGIC):])
                info = json.loads(f.read(meta_len))
            if info["fingerprint"] != self.fingerprint:
                return None
            size = os.path.getsize(path)
            if size != len(head) + meta_len + _DIGEST + info["body"]:
                return None                                   # truncated
            return PageHeader(bytes.fromhex(info["key"]), bytes.fromhex(info["parent"]), bytes.fromhex(info["salt"]),
                               tuple(int(t) for t in info["tokens"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write_file(self, path: Path, head: bytes, views) -> None:
        if self._kvikio is not None:
            import numpy as np
            with self._kvikio.CuFile(path, "w") as f:
                # the header and each tensor at its offset, split over KvikIO's own threads
                futures, offset = [f.pwrite(np.frombuffer(head, dtype=np.uint8), file_offset=0)], len(head)
                for v in views:
                    futures.append(f.pwrite(v, file_offset=offset))
                    offset += v.nbytes
                for fut in futures:
                    fut.get()
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, head)
            os.writev(fd, views)
        finally:
            os.close(fd)

    def _read_body(self, f, offset: int, views) -> int:
        if self._kvikio is not None:
            with self._kvikio.CuFile(f.name, "r") as kf:
                futures = []
                for v in views:
                    futures.append(kf.pread(v, file_offset=offset))
                    offset += v.nbytes
                return sum(fut.get() for fut in futures)
        f.seek(offset)
        return sum(f.readinto(v) for v in views)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _kvikio_works(kvikio, directory: Path) -> bool:
    """KvikIO imports on a machine without a GPU yet fails its first I/O (no libcuda): write and read
    one small page file through the same calls the store makes, and use KvikIO only if that works."""
    probe = DiskStore.__new__(DiskStore)
    probe.fingerprint, probe.dir, probe._kvikio = "probe", directory, kvikio
    key = b"kvikio-probe"
    try:
        data = torch.arange(64, dtype=torch.uint8)
        probe.write(key, b"", b"", (), [data])
        back = torch.zeros(64, dtype=torch.uint8)
        return probe.read_into(key, [back]) and torch.equal(back, data)
    except Exception:
        return False
    finally:
        _unlink(str(probe.path(key)))
