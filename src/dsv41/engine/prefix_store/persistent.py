"""Persistent prefix store: one file per prefix unit on local disk, an SQLite index beside it (SPEC §6).

A prefix unit is the packed global KV (FP4 main entries + FP4 index keys) of every kv-source layer for one
token prefix; this module only sees named tensors + a small JSON `meta` under a hex key. Layout under `root`:

    index.sqlite                  units(hash, n_tokens, nbytes, checksum, created, last_access, meta, parent), WAL
    blobs/<hash[:2]>/<hash>.bin   one blob per unit (format below)

Durability order of `put`: temp file in the blob's directory → fsync → (SQLite write lock) rename → fsync dir →
commit the index row. A row therefore always names a complete file; a crash leaves at worst a temp file or a
renamed blob without a row, and both are removed at the next open. The rename happens while this process holds
the SQLite write lock, so the orphan scan at open (which takes the same lock) never sees another live process's
uncommitted blob. Reads check size + SHA-256 against the row; anything missing, truncated or corrupt is a miss:
the blob and its row are dropped and a warning is logged once per key. Bad bytes are never returned.

Lifetime: an entry lives `ttl_s` (default 72 h) after its *last access*, not after its creation, so a hot
system prompt never expires while in use (the report's "≥ 72 h life"). A hit refreshes last access at most once
per `touch_interval_s` (default 60 s): each refresh is a write transaction, and a minute is plenty of resolution
for LRU and TTL on this scale. When the blob bytes would exceed
`capacity_bytes` the least recently used *leaves* are evicted before the insert. Capacity counts blob bytes only.

Parents: a unit is a delta over its parent unit (`parent` column, indexed), useless without it. So a unit is
only stored while its parent is (`put` refuses an orphan), eviction takes leaves first (a parent goes only once
its children have), and whatever removes a unit otherwise — expiry, a corrupt blob, `delete`, a row whose blob is
gone at open — removes its descendants with it, in the same transaction. No unit ever outlives its parent.

Blob format (version 1), little-endian:
    0   8  magic b"DSV41PU\\0"
    8   4  u32 format version (1)
    12  4  u32 reserved (0)
    16  8  u64 json_len       (JSON header, space-padded to a multiple of 64)
    24  8  u64 data_len       (tensor bytes, each tensor starting at a multiple of 64)
    32 32  SHA-256 over bytes [0, 32) + everything after byte 64; the index row holds the same digest
    64     JSON {"meta": {...}, "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}
           tensor data (offsets relative to the start of the data section)
The same encoding (`encode_unit` / `decode_unit`) serializes the SWA pool's values.

Several processes may share a root on a local filesystem (WAL needs shared memory: not NFS). A power loss may
forget the last few commits (synchronous=NORMAL); their blobs then become orphans and are cleaned at open.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import sqlite3
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

GiB = 1024**3

# ---------------------------------------------------------------------------------------------------------
# Blob format: shared by the persistent store and the SWA pool
# ---------------------------------------------------------------------------------------------------------

MAGIC = b"DSV41PU\x00"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQQ32s")  # magic, version, reserved, json_len, data_len, sha256
HEADER_BYTES = _HEADER.size  # 64
_ALIGN = 64


class CorruptBlob(ValueError):
    """A blob that fails its checks (magic, version, lengths, checksum, tensor table)."""


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptBlob(f"unknown dtype {name!r}")
    return dtype


def encode_unit_parts(tensors: dict[str, Tensor], meta: dict) -> tuple[list, str]:
    """The blob as a list of buffers (written without concatenating) and its SHA-256 hex digest."""
    table, datas, offset = [], [], 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # (nbytes,) shares memory with t
        table.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "offset": offset, "nbytes": int(raw.nbytes)})
        datas.append(memoryview(raw))
        offset += raw.nbytes
        if _pad(offset):
            datas.append(bytes(_pad(offset)))
            offset += _pad(offset)
    header_json = json.dumps({"meta": meta, "tensors": table}, separators=(",", ":")).encode()
    header_json += b" " * _pad(len(header_json))
    head32 = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(header_json), offset, bytes(32))[:32]
    digest = hashlib.sha256(head32)
    digest.update(header_json)
    for d in datas:
        digest.update(d)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(header_json), offset, digest.digest())
    return [header, header_json, *datas], digest.hexdigest()


def encode_unit(tensors: dict[str, Tensor], meta: dict) -> bytes:
    """Serialize named tensors (any dtype, any device; copied to CPU) + JSON-able meta into one blob."""
    parts, _ = encode_unit_parts(tensors, meta)
    return b"".join(parts)


def blob_checksum(buf: bytes | bytearray | memoryview) -> str:
    """The SHA-256 a well-formed blob carries in its header (recomputed from the bytes)."""
    view = memoryview(buf)
    digest = hashlib.sha256(view[:32])
    digest.update(view[HEADER_BYTES:])
    return digest.hexdigest()


def decode_unit(buf: bytes | bytearray, expected_checksum: str | None = None) -> tuple[dict[str, Tensor], dict]:
    """Parse and verify a blob. Tensors are views into `buf` (copied first if `buf` is immutable bytes)."""
    if len(buf) < HEADER_BYTES:
        raise CorruptBlob(f"blob of {len(buf)} bytes is shorter than the header")
    magic, version, reserved, json_len, data_len, stored = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != FORMAT_VERSION or reserved != 0:
        raise CorruptBlob(f"bad magic/version {magic!r}/{version}")
    if HEADER_BYTES + json_len + data_len != len(buf):
        raise CorruptBlob(f"length {len(buf)} != header {HEADER_BYTES} + json {json_len} + data {data_len}")
    actual = blob_checksum(buf)
    if actual != stored.hex() or (expected_checksum is not None and actual != expected_checksum):
        raise CorruptBlob("checksum mismatch")
    if isinstance(buf, bytes):
        buf = bytearray(buf)  # torch.frombuffer wants a writable buffer
    try:
        head = json.loads(bytes(buf[HEADER_BYTES:HEADER_BYTES + json_len]))
        meta, table = head["meta"], head["tensors"]
        data_start = HEADER_BYTES + json_len
        tensors = {}
        for e in table:
            dtype, shape, nbytes, offset = _dtype_from_name(e["dtype"]), e["shape"], e["nbytes"], e["offset"]
            if offset < 0 or offset + nbytes > data_len:
                raise CorruptBlob(f"tensor {e['name']!r} lies outside the data section")
            if nbytes == 0:
                tensors[e["name"]] = torch.empty(shape, dtype=dtype)
                continue
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=data_start + offset)
            tensors[e["name"]] = raw.view(dtype).reshape(shape)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        if isinstance(exc, CorruptBlob):
            raise
        raise CorruptBlob(f"bad tensor table: {exc}") from exc
    return tensors, meta


# ---------------------------------------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------------------------------------

_KEY_RE = re.compile(r"^[0-9a-f]{8,128}$")
TEMP_FILE_RE = re.compile(r"^\.tmp-(\d+)-[0-9a-f]+\.bin$")
_STALE_TMP_S = 3600.0  # temp files of live pids older than this are also removed (pid reuse, other hosts)
_SCHEMA_VERSION = 2  # 2: the parent and anchor columns
_SCHEMA = """
CREATE TABLE IF NOT EXISTS units (
    hash TEXT PRIMARY KEY,
    n_tokens INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    meta TEXT NOT NULL,
    parent TEXT,
    anchor TEXT
);
CREATE INDEX IF NOT EXISTS units_last_access ON units(last_access);
CREATE INDEX IF NOT EXISTS units_n_tokens ON units(n_tokens);
CREATE INDEX IF NOT EXISTS units_parent ON units(parent);
CREATE INDEX IF NOT EXISTS units_anchor ON units(anchor, n_tokens);
"""
_DESCENDANTS = """
WITH RECURSIVE d(h) AS (SELECT ? UNION SELECT u.hash FROM units u JOIN d ON u.parent = d.h) SELECT h FROM d
"""


def default_cache_root() -> Path:
    """$DSV41_CACHE_DIR/prefix, else $XDG_CACHE_HOME/dsv41/prefix, else ~/.cache/dsv41/prefix."""
    if os.environ.get("DSV41_CACHE_DIR"):
        return Path(os.environ["DSV41_CACHE_DIR"]).expanduser() / "prefix"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "dsv41" / "prefix"


def normalize_key(key: bytes | str) -> str:
    """Keys are hashes: raw bytes or lowercase hex (8..128 hex digits)."""
    text = key.hex() if isinstance(key, (bytes, bytearray)) else str(key).lower()
    if not _KEY_RE.match(text):
        raise ValueError(f"prefix-store key must be 8..128 hex digits, got {key!r}")
    return text


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PersistentStore:
    """Disk tier of the prefix cache: LRU by last access, TTL by last access, checksummed, crash safe."""

    def __init__(self, root: Path | str | None = None, capacity_bytes: int = 20 * GiB, ttl_s: float = 72 * 3600.0,
                 clock: Callable[[], float] = time.time, touch_interval_s: float = 60.0, busy_timeout_s: float = 30.0):
        self.root = Path(root) if root is not None else default_cache_root()
        self.capacity_bytes = int(capacity_bytes)
        self.ttl_s = float(ttl_s)
        self.clock = clock
        self.touch_interval_s = float(touch_interval_s)
        self.blob_dir = self.root / "blobs"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._warned: set[str] = set()  # keys / error kinds already logged at WARNING
        self._counters = dict(hits=0, misses=0, evictions=0, expired=0, bytes_written=0, bytes_read=0,
                              corrupt_dropped=0, write_errors=0, orphans_removed=0, temp_removed=0,
                              orphans_refused=0, descendants_dropped=0)
        self._db = sqlite3.connect(self.root / "index.sqlite", timeout=busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        with self._lock:
            self._open_schema()
            self._clean_at_open()
            self.purge_expired()

    # ---- public API ------------------------------------------------------------------------------------

    def put(self, key: bytes | str, tensors: dict[str, Tensor], meta: dict, *, n_tokens: int | None = None,
            parent: bytes | str | None = None) -> bool:
        """Store a unit; False (logged once per error kind) when it could not be written, or when `parent` (the
        unit it extends; default: meta["parent"]) is not stored. Same key = same prefix under the same salt, so a
        valid existing entry is only touched, not rewritten."""
        key = normalize_key(key)
        parent = meta.get("parent") if parent is None else parent
        parent = None if parent is None else normalize_key(parent)
        anchor = meta.get("anchor")
        anchor = None if anchor is None else normalize_key(anchor)
        n_tokens = int(meta.get("n_tokens", 0) if n_tokens is None else n_tokens)
        meta_text = json.dumps(meta, separators=(",", ":"))
        parts, checksum = encode_unit_parts(tensors, meta)
        nbytes = sum(memoryview(p).nbytes for p in parts)
        if nbytes > self.capacity_bytes:
            self._warn_once("too-large", "prefix unit of %d bytes exceeds the store capacity %d; not stored",
                            nbytes, self.capacity_bytes)
            return False
        final = self._blob_path(key)
        tmp = final.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex}.bin"
        try:
            self._mkdir_blob_parent(final.parent)
            self._write_file(tmp, parts)
            with self._lock, self._write_txn():
                row = self._db.execute("SELECT checksum, nbytes FROM units WHERE hash=?", (key,)).fetchone()
                if row is not None and row[0] == checksum and _file_size(final) == row[1]:
                    self._db.execute("UPDATE units SET last_access=? WHERE hash=?", (self.clock(), key))
                    tmp.unlink(missing_ok=True)
                    return True
                self._purge_expired_locked()
                if parent is not None and self._db.execute("SELECT 1 FROM units WHERE hash=?",
                                                           (parent,)).fetchone() is None:
                    tmp.unlink(missing_ok=True)
                    self._counters["orphans_refused"] += 1
                    return False  # its parent was evicted or never written: the unit would be unusable
                self._evict_locked(nbytes, exclude={key, parent})
                os.replace(tmp, final)
                _fsync_dir(final.parent)
                now = self.clock()
                self._db.execute("INSERT OR REPLACE INTO units VALUES (?,?,?,?,?,?,?,?,?)",
                                 (key, n_tokens, nbytes, checksum, now, now, meta_text, parent, anchor))
                self._counters["bytes_written"] += nbytes
            return True
        except (OSError, sqlite3.Error) as exc:
            with self._lock:
                self._counters["write_errors"] += 1
            kind = f"write:{getattr(exc, 'errno', None) or type(exc).__name__}"
            self._warn_once(kind, "prefix store write failed under %s (%s); serving continues without it",
                            self.root, exc)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return False

    def get(self, key: bytes | str) -> tuple[dict[str, Tensor], dict] | None:
        """The unit's tensors and meta, or None (absent, expired, missing or corrupt blob). Refreshes last access."""
        key = normalize_key(key)
        with self._lock:
            row = self._db.execute("SELECT nbytes, checksum, last_access FROM units WHERE hash=?",
                                   (key,)).fetchone()
            if row is None:
                self._counters["misses"] += 1
                return None
            nbytes, checksum, last_access = row
            if self.clock() - last_access > self.ttl_s:
                self._drop(key, checksum, reason=None)
                self._counters["expired"] += 1
                self._counters["misses"] += 1
                return None
        try:
            buf = _read_file(self._blob_path(key), nbytes)
            tensors, meta = decode_unit(buf, expected_checksum=checksum)
        except (OSError, CorruptBlob) as exc:
            with self._lock:
                self._drop(key, checksum, reason=str(exc))
                self._counters["misses"] += 1
            return None
        with self._lock:
            now = self.clock()
            if now - last_access >= self.touch_interval_s:  # each touch takes the cross-process write lock
                try:
                    self._db.execute("UPDATE units SET last_access=? WHERE hash=?", (now, key))
                except sqlite3.Error as exc:  # a busy index must not turn a verified hit into a miss
                    self._warn_once("touch", "prefix store could not refresh last access (%s)", exc)
            self._counters["hits"] += 1
            self._counters["bytes_read"] += nbytes
        return tensors, meta

    def contains(self, key: bytes | str) -> bool:
        """Indexed and not expired (the blob itself is only checked by `get`)."""
        return bool(self.present([key]))

    def present(self, keys: Iterable[bytes | str]) -> set[str]:
        """The subset of `keys` (as hex) that is indexed and not expired: one query per 500 keys."""
        keys = [normalize_key(k) for k in keys]
        found: set[str] = set()
        with self._lock:
            oldest = self.clock() - self.ttl_s
            for i in range(0, len(keys), 500):
                chunk = keys[i:i + 500]
                marks = ",".join("?" * len(chunk))
                rows = self._db.execute(f"SELECT hash FROM units WHERE last_access >= ? AND hash IN ({marks})",
                                        (oldest, *chunk)).fetchall()
                found.update(r[0] for r in rows)
        return found

    def lengths(self) -> list[int]:
        """Distinct prefix lengths (n_tokens) of live entries, ascending: the only places a hit can end."""
        with self._lock:
            rows = self._db.execute("SELECT DISTINCT n_tokens FROM units WHERE last_access >= ? ORDER BY n_tokens",
                                    (self.clock() - self.ttl_s,)).fetchall()
        return [r[0] for r in rows]

    def lengths_under(self, anchors: Iterable[bytes | str]) -> set[int]:
        """Prefix lengths of live units filed under any of `anchors` (meta["anchor"]): indexed, no scan."""
        anchors = [normalize_key(a) for a in anchors]
        found: set[int] = set()
        with self._lock:
            oldest = self.clock() - self.ttl_s
            for i in range(0, len(anchors), 500):
                chunk = anchors[i:i + 500]
                rows = self._db.execute(f"SELECT DISTINCT n_tokens FROM units WHERE anchor IN "
                                        f"({','.join('?' * len(chunk))}) AND last_access >= ?",
                                        (*chunk, oldest)).fetchall()
                found.update(r[0] for r in rows)
        return found

    def keys(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT hash FROM units ORDER BY last_access").fetchall()]

    def delete(self, key: bytes | str) -> bool:
        """Remove a unit and every unit that extends it (they would be unusable)."""
        key = normalize_key(key)
        with self._lock, self._write_txn():
            return self._remove_tree_locked(key) > 0

    def purge_expired(self) -> int:
        """Drop entries whose last access is older than the TTL (and their descendants); returns how many."""
        with self._lock, self._write_txn():
            return self._purge_expired_locked()

    def touch(self, keys: Iterable[bytes | str]) -> None:
        """Refresh the last access of `keys` (units served from a memory tier), at most once per touch interval."""
        keys = [normalize_key(k) for k in keys]
        now = self.clock()
        try:
            with self._lock:
                for i in range(0, len(keys), 500):
                    chunk = keys[i:i + 500]
                    self._db.execute(f"UPDATE units SET last_access=? WHERE last_access < ? AND hash IN "
                                     f"({','.join('?' * len(chunk))})", (now, now - self.touch_interval_s, *chunk))
        except sqlite3.Error as exc:
            self._warn_once("touch", "prefix store could not refresh last access (%s)", exc)

    def parents(self) -> dict[str, str | None]:
        """hash → parent hash of every indexed unit (for checks and tests)."""
        with self._lock:
            return dict(self._db.execute("SELECT hash, parent FROM units").fetchall())

    def verify_all(self) -> int:
        """Read and checksum every blob; drop the bad ones. Returns how many were dropped."""
        dropped = 0
        with self._lock:
            rows = self._db.execute("SELECT hash, nbytes, checksum FROM units").fetchall()
        for key, nbytes, checksum in rows:
            try:
                decode_unit(_read_file(self._blob_path(key), nbytes), expected_checksum=checksum)
            except (OSError, CorruptBlob) as exc:
                with self._lock:
                    dropped += self._drop(key, checksum, reason=str(exc))
        return dropped

    def stats(self) -> dict[str, int]:
        with self._lock:
            entries, total = self._db.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM units").fetchone()
            return dict(entries=entries, bytes=total, **self._counters)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> PersistentStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------------------

    def _blob_path(self, key: str) -> Path:
        return self.blob_dir / key[:2] / f"{key}.bin"

    def _begin(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")  # takes the cross-process write lock (waits up to busy_timeout)

    @contextlib.contextmanager
    def _write_txn(self):
        """BEGIN IMMEDIATE … COMMIT, rolled back on any exception (the caller holds self._lock)."""
        self._begin()
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise

    def _remove_tree_locked(self, key: str) -> int:
        """(in a write transaction) Delete `key` and all its descendants, rows and blobs; returns how many."""
        tree = [r[0] for r in self._db.execute(_DESCENDANTS, (key,)).fetchall()]
        removed = 0
        for k in tree:
            if self._db.execute("DELETE FROM units WHERE hash=?", (k,)).rowcount:
                removed += 1
            self._blob_path(k).unlink(missing_ok=True)
        self._counters["descendants_dropped"] += max(0, removed - 1)
        return removed

    def _rollback(self) -> None:
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    def _warn_once(self, kind: str, msg: str, *args) -> None:
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        log.log(logging.WARNING if first else logging.DEBUG, msg, *args)

    def _open_schema(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, _SCHEMA_VERSION):
            # a cache: an index from another schema is dropped, its blobs become orphans and are cleaned below
            log.warning("prefix store %s has index schema %d (expected %d); starting empty", self.root, version,
                        _SCHEMA_VERSION)
            self._db.execute("DROP TABLE IF EXISTS units")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")

    def _clean_at_open(self) -> None:
        """Under the write lock: remove dead writers' temp files, blobs without rows, rows without (whole) blobs."""
        with self._write_txn():
            rows = {k: n for k, n in self._db.execute("SELECT hash, nbytes FROM units")}
            seen: set[str] = set()
            now = time.time()
            for sub in self.blob_dir.iterdir() if self.blob_dir.is_dir() else ():
                if not sub.is_dir():
                    continue
                for f in sub.iterdir():
                    m = TEMP_FILE_RE.match(f.name)
                    if m:
                        if not _pid_alive(int(m.group(1))) or now - _mtime(f) > _STALE_TMP_S:
                            f.unlink(missing_ok=True)
                            self._counters["temp_removed"] += 1
                        continue
                    key = f.name.removesuffix(".bin")
                    if f.suffix == ".bin" and key in rows:
                        seen.add(key)
                        continue
                    f.unlink(missing_ok=True)  # renamed before a crash, never committed
                    self._counters["orphans_removed"] += 1
            bad = [k for k, n in rows.items() if k not in seen or _file_size(self._blob_path(k)) != n]
            for k in bad:
                self._remove_tree_locked(k)
            # rows whose parent row is gone (written by an older version, or a crash between two commits)
            stranded = [k for (k,) in self._db.execute(
                "SELECT u.hash FROM units u WHERE u.parent IS NOT NULL AND NOT EXISTS "
                "(SELECT 1 FROM units p WHERE p.hash = u.parent)").fetchall()]
            for k in stranded:
                self._remove_tree_locked(k)
        if bad or stranded:
            self._counters["corrupt_dropped"] += len(bad)
            log.warning("prefix store %s: dropped %d index rows whose blobs are missing or truncated", self.root,
                        len(bad))

    def _mkdir_blob_parent(self, parent: Path) -> None:
        if not parent.is_dir():
            parent.mkdir(parents=True, exist_ok=True)
            _fsync_dir(parent.parent)

    @staticmethod
    def _write_file(path: Path, parts: list) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    n = os.write(fd, view)
                    if n <= 0:
                        raise OSError(errno.EIO, f"short write to {path}")
                    view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)

    def _purge_expired_locked(self) -> int:
        rows = self._db.execute("SELECT hash FROM units WHERE last_access < ?",
                                (self.clock() - self.ttl_s,)).fetchall()
        n = 0
        for (key,) in rows:  # an expired unit takes its descendants along (they cannot be resumed without it)
            n += self._remove_tree_locked(key)
        self._counters["expired"] += n
        return n

    def _evict_locked(self, incoming: int, exclude: set[str | None]) -> None:
        """LRU eviction among leaves (units no other unit extends) until `incoming` more bytes fit."""
        total = self._db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM units").fetchone()[0]
        keep = [k for k in exclude if k is not None]
        marks = ",".join("?" * len(keep))
        while total + incoming > self.capacity_bytes:
            leaves = self._db.execute(
                f"SELECT hash, nbytes FROM units u WHERE hash NOT IN ({marks}) AND NOT EXISTS "
                f"(SELECT 1 FROM units c WHERE c.parent = u.hash) ORDER BY last_access LIMIT 64", keep).fetchall()
            if not leaves:
                break
            for key, nbytes in leaves:
                self._db.execute("DELETE FROM units WHERE hash=?", (key,))
                self._blob_path(key).unlink(missing_ok=True)
                self._counters["evictions"] += 1
                total -= nbytes
                if total + incoming <= self.capacity_bytes:
                    break

    def _drop(self, key: str, checksum: str, reason: str | None) -> int:
        """Remove `key` if its row still carries `checksum`. A row that changed or vanished meanwhile (another
        thread or process evicted or re-put it) is left alone: that was a benign race, not a bad blob."""
        try:
            with self._write_txn():
                row = self._db.execute("SELECT checksum FROM units WHERE hash=?", (key,)).fetchone()
                if row is None or row[0] != checksum:
                    return 0
                self._remove_tree_locked(key)
        except (OSError, sqlite3.Error) as exc:
            self._warn_once("drop", "prefix store could not drop %s… (%s)", key[:16], exc)
            return 0
        if reason is not None:
            self._warn_once(f"corrupt:{key}", "prefix store: dropped %s… (%s)", key[:16], reason)
            self._counters["corrupt_dropped"] += 1
        return 1


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _read_file(path: Path, nbytes: int) -> bytearray:
    """Read exactly `nbytes` (the indexed size); a different size is corruption."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != nbytes:
            raise CorruptBlob(f"size {size} != indexed {nbytes}")
        buf = bytearray(nbytes)
        view, got = memoryview(buf), 0
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise CorruptBlob(f"short read at {got} of {nbytes}")
            got += n
    return buf
