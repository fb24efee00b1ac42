"""What a worker of ``python -m gradsync.launch`` sees of its own process:
printed as one JSON line, then it ends as its arguments say (test_launch.py)."""

import atexit
import json
import os
import sys

import probe_helper  # next to this script: found through sys.path[0]

if __name__ == "__main__":
    member = int(os.environ["GRADSYNC_MEMBER"])
    atexit.register(lambda: print(f"member {member}: atexit ran", flush=False))
    print(json.dumps({
        "member": member,
        "argv": sys.argv,
        "path0": sys.path[0],
        "helper": probe_helper.NAME,
        "env": os.environ.get("PROBE_VALUE"),
        "c_env": os.popen("echo $PROBE_VALUE").read().strip(),
        "pid": os.getpid(),
        "main_file": sys.modules["__main__"].__file__,
    }))
    how = sys.argv[1 + member] if len(sys.argv) > 1 + member else "ok"
    # A line without a newline reaches the supervisor's output at once (-u).
    sys.stdout.write(f"member {member}: unbuffered")
    if how == "exit5":
        sys.exit(5)
    if how == "raise":
        raise RuntimeError(f"member {member} raised")
