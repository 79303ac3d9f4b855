"""A daemon that admits only uid (own uid + 1): the SO_PEERCRED check, for real, on any machine.

    python peer_seam.py SIDECAR SOCKET

The peer's credentials still come from the kernel; only the uid they are compared with differs
from ``mpack serve`` (which admits its own uid), so any connection from this user is a
"peer with another uid".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mpack.runtime.allocation import plan_rank
from mpack.runtime.daemon import Daemon, Served
from mpack.runtime.memfd import HostExport
from mpack.runtime.protocol import Device


def main() -> None:
    plan = plan_rank(sys.argv[1], 0)
    export = HostExport.create(plan, "peer-seam")
    served = Served(plan, Device("cpu", None, "cpu"), export)
    daemon = Daemon(served, Path(sys.argv[2]), owner_uid=os.getuid() + 1, on_event=print)
    daemon.run(on_ready=lambda info: print("READY", flush=True))
    export.close()


if __name__ == "__main__":
    main()
