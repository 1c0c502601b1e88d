"""A stand-in CLI for tests/test_cli_batch.py: each argument does one thing a real CLI might do to
its process (write through logging, warnings, fd 2 or stdout, change env or cwd, exit oddly)."""

import atexit
import logging
import os
import sys
import warnings

for arg in sys.argv[1:]:
    if arg == "log":  # the first call configures logging: a second one adding a handler would double lines
        logging.basicConfig(format="LOG %(message)s")
        logging.getLogger("probe").addHandler(logging.StreamHandler(sys.stderr))
        logging.getLogger("probe").warning("a warning through logging")
    elif arg == "warn":  # shown once per process: a registry left from an earlier call would hide it
        warnings.warn("a UserWarning", stacklevel=1)
    elif arg == "fd2":
        os.write(2, b"written on fd 2\n")
    elif arg == "stdout":
        print("on stdout", end="")  # buffered: only a flush at exit writes it
    elif arg == "env":
        print(f"X={os.environ.get('X')} LEAK={os.environ.get('LEAK')} cwd={os.getcwd()} argv0={os.path.basename(sys.argv[0])}")
        os.environ["LEAK"] = "1"
        os.chdir("/")
    elif arg == "atexit":
        atexit.register(lambda: print("said at exit", file=sys.stderr))
    elif arg == "raise":
        raise RuntimeError("a program error")
    elif arg == "exitmsg":
        sys.exit("a message to exit with")
    elif arg == "hang":
        import time

        time.sleep(600)
    elif arg.startswith("exit="):
        sys.exit(int(arg[5:]))
