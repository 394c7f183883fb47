"""Driver run in a fresh process by test_ray_launcher.py (Ray must not be initialised yet).

    python tests/ray_script.py local             # run_ray on this machine only; prints JSON
    python tests/ray_script.py address HOST:PORT # run_ray against a cluster address

Prints one JSON line: {"ok": value} or {"error": the AtollError line}.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch_fns import collective, listening_after_rendezvous  # noqa: E402

from atoll.errors import AtollError  # noqa: E402
from atoll.launch.ray_launcher import run_ray  # noqa: E402


def main() -> int:
    try:
        if sys.argv[1] == "local":
            value = run_ray(listening_after_rendezvous, 2, os.getpid(), timeout_s=240)[0]
        else:
            value = run_ray(collective, 2, address=sys.argv[2], timeout_s=60)
    except AtollError as e:
        print(json.dumps({"error": str(e)}))
        return 2
    print(json.dumps({"ok": value}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
