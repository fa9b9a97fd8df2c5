"""Runs inside the sandbox's namespaces (see sandbox.py): limits, identity, audit hook, then the code.

Started as `python -I -S sandbox_runner.py SCRATCH LIMITS_JSON`; imports only the standard library.
"""

import json
import os
import resource
import sys


def _limit(kind, value):
    resource.setrlimit(kind, (value, value))


def main():
    scratch, limits = sys.argv[1], json.loads(sys.argv[2])
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    _limit(resource.RLIMIT_AS, limits["memory_bytes"])
    _limit(resource.RLIMIT_FSIZE, limits["file_bytes"])
    _limit(resource.RLIMIT_NOFILE, limits["max_open_files"])
    _limit(resource.RLIMIT_CORE, 0)
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    _limit(resource.RLIMIT_NPROC, limits["max_processes"])
    os.chdir(scratch)
    readable = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                             os.path.dirname(os.__file__)})
    scratch_dir = os.path.realpath(scratch) + os.sep
    refused = {"socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
               "os.forkpty", "os.kill", "os.killpg", "pty.", "ctypes.", "winreg.", "os.chroot",
               "os.link", "os.symlink", "os.setuid", "os.chown", "os.chmod"}
    native = {"ctypes", "_ctypes", "cffi", "mmap", "_posixsubprocess", "_socket", "socket", "ssl"}

    def hook(event, args):
        if any(event.startswith(r) for r in refused):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in native:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode = args[0], args[1]
            if isinstance(path, int):
                return
            real = os.path.realpath(os.fsdecode(path)) + ("" if os.path.isdir(path) else "")
            writing = isinstance(mode, str) and any(c in mode for c in "wax+")
            if isinstance(mode, int):
                writing = bool(mode & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            inside = (real + os.sep).startswith(scratch_dir) or real.startswith(scratch_dir)
            if not inside and (writing or not real.startswith(readable)):
                raise PermissionError(f"sandbox: opening {path!r} is not allowed")

    code_path = os.path.join(scratch, "main.py")
    with open(code_path) as f:
        source = f.read()
    code = compile(source, "main.py", "exec")
    sys.argv = ["main.py"]
    sys.path[:] = [p for p in sys.path if p] + [scratch]
    if limits["audit_hook"]:
        sys.addaudithook(hook)
    namespace = {"__name__": "__main__", "__file__": "main.py"}
    exec(code, namespace)


if __name__ == "__main__":
    main()
