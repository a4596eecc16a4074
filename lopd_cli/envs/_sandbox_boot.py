"""Boot process of the sandbox: isolate, then run the untrusted program (stdlib only).

Run by `sandbox.run_python` as `python -I _sandbox_boot.py CONFIG_JSON` in a new session with
stdout/stderr already pointing at capture files. It never imports lopd (it runs under `-I`).

Steps, each applied where the OS allows and recorded in the status it reports:
1. unshare mount, network and PID namespaces (as root directly; otherwise inside a new user
   namespace that maps the caller's uid to 0);
2. make every mount read-only except the throw-away working folder; as root, bind the Python
   installation onto a world-readable mount point so an unprivileged uid can run it;
3. fork the namespace's init (pid 1), which mounts a fresh /proc and forks the program;
4. the program process sets rlimits (CPU, address space, processes, file size, no core), drops
   the capability bounding set, sets no_new_privs, drops to an unprivileged uid (as root) and
   execs `python -I -B main.py` with a minimal environment.
When init exits, the kernel kills everything left in the PID namespace (fork bombs included).
The outcome goes back to the parent as one JSON line on the status pipe.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
_FLAG_BITS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, None), f"mount {target}")


def _unescape(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    return path.encode().decode("unicode_escape") if "\\" in path else path


def _mounts() -> list[tuple[str, int]]:
    """(mount point, flags to keep) for every mount, parents first."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            flags = 0
            for opt in parts[5].split(","):
                flags |= _FLAG_BITS.get(opt, 0)
            out.append((_unescape(parts[4]), flags))
    return out


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def isolate(cfg: dict, features: list[str]) -> None:
    """Namespaces and read-only mounts; appends what worked to `features`."""
    root = os.geteuid() == 0
    want = CLONE_NEWNS | CLONE_NEWPID | (0 if cfg["network"] else CLONE_NEWNET)
    uid, gid = os.getuid(), os.getgid()
    if root:
        # Root maps to root in a user namespace (no process limit), so no fallback to one.
        if libc.unshare(want) != 0:
            return
    elif libc.unshare(want | CLONE_NEWUSER) == 0:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")
        features.append("userns")
    else:
        return
    features += ["mountns", "pidns"] + ([] if cfg["network"] else ["netns"])
    if not cfg["network"]:
        # A fresh network namespace has only a downed loopback: no route anywhere.
        features.append("no-network")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    work = cfg["workdir"]
    _mount(work, work, None, MS_BIND | MS_REC)
    if cfg.get("python_mount"):
        _mount(cfg["python_prefix"], cfg["python_mount"], None, MS_BIND | MS_REC)
    failed = 0
    for point, keep in _mounts():
        if point == work or point.startswith(work + "/"):
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError:
            failed += 1
    if failed == 0 or _is_readonly("/"):
        features.append("readonly-fs")


def _is_readonly(path: str) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def _limits(cfg: dict) -> None:
    cpu = max(1, int(cfg["cpu_s"] + 0.999))
    mem = int(cfg["memory_mb"]) * 1024 * 1024
    fsize = int(cfg["max_file_mb"]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["max_procs"], cfg["max_procs"]))


def _drop_privileges(cfg: dict) -> None:
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows (or not permitted)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if os.geteuid() == 0 and cfg.get("run_uid") is not None and "userns" not in cfg["_features"]:
        os.setgroups([])
        os.setresgid(cfg["run_uid"], cfg["run_uid"], cfg["run_uid"])
        os.setresuid(cfg["run_uid"], cfg["run_uid"], cfg["run_uid"])


def run_program(cfg: dict) -> None:
    """In the program process: limits, privileges, exec. Never returns."""
    try:
        os.chdir(cfg["workdir"])
        _drop_privileges(cfg)
        _limits(cfg)
        argv = [cfg["python"], "-I", "-B", cfg["script"]]
        os.execve(cfg["python"], argv, cfg["env"])
    except BaseException as e:  # noqa: BLE001 — report why the program could not start
        os.write(2, f"sandbox: cannot start program: {e.__class__.__name__}: {e}\n".encode())
        os._exit(126)


def _status_of(wait_status: int) -> dict:
    if os.WIFSIGNALED(wait_status):
        return {"signal": os.WTERMSIG(wait_status)}
    return {"exit": os.WEXITSTATUS(wait_status)}


def init_process(cfg: dict, status_fd: int) -> None:
    """pid 1 of the new namespace (or a plain child): run the program, report, exit."""
    if "pidns" in cfg["_features"]:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError:
            pass
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        run_program(cfg)
    _, st = os.waitpid(pid, 0)
    status = _status_of(st)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    status["cpu_s"] = usage.ru_utime + usage.ru_stime
    status["features"] = cfg["_features"]
    os.write(status_fd, (json.dumps(status) + "\n").encode())
    os._exit(0)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status_fd = int(cfg["status_fd"])
    features: list[str] = ["rlimits"]
    try:
        isolate(cfg, features)
    except OSError as e:
        os.write(status_fd, (json.dumps({"setup_error": str(e), "features": features}) + "\n").encode())
        sys.exit(0)
    if os.geteuid() == 0 and cfg.get("run_uid") is not None and "userns" not in features:
        features.append("unprivileged-uid")
    cfg["_features"] = features
    os.write(status_fd, (json.dumps({"features": features}) + "\n").encode())
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        init_process(cfg, status_fd)
    os.close(status_fd)
    _, st = os.waitpid(pid, 0)
    sys.exit(0 if os.WIFEXITED(st) else 1)


if __name__ == "__main__":
    main()
