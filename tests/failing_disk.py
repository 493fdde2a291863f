"""`python failing_disk.py ERRNO N ARGS...`: elastic-oneshot ARGS on a disk that refuses its N-th file write and
every later one with ERRNO (ENOSPC: full; EROFS: remounted read-only), where mounting a small tmpfs is not allowed.
A write is refused where the disk reports it: at the fsync of a regular file."""

import errno
import os
import stat
import sys


def refuse_writes(code: int, after: int):
    real, seen = os.fsync, [0]

    def fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            seen[0] += 1
            if seen[0] >= after:
                raise OSError(code, os.strerror(code))
        real(fd)

    os.fsync = fsync


if __name__ == "__main__":
    refuse_writes(getattr(errno, sys.argv[1]), int(sys.argv[2]))
    from elastic_oneshot.surface.cli import entry

    entry(sys.argv[3:])
