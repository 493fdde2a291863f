"""The per-layer progress bar with ETA: rank 0 draws it, the other ranks stay quiet."""

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

_open: list["LayerBar"] = []


def close_all():
    """End every bar still drawn, so that an error line that follows starts on a line of its own."""
    for bar in list(_open):
        bar.close()


class LayerBar:
    """One tick per committed layer; layers committed before this process started count as done, not as
    speed. While it is drawn, log lines print above it instead of through it."""

    def __init__(self, total: int, done: int, show: bool):
        self.bar = tqdm(total=total, initial=done, desc="layers", unit="layer", disable=not show,
                        dynamic_ncols=True)
        self._logs = logging_redirect_tqdm() if show and done < total else None
        if self._logs:
            self._logs.__enter__()
        _open.append(self)
        self.update(done)

    def update(self, done: int):
        """`done`: layers committed now (a redone layer does not move the bar)."""
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        if done >= self.bar.total:
            self.close()

    def close(self):
        if self in _open:
            _open.remove(self)
        self.bar.close()
        if self._logs:
            self._logs.__exit__(None, None, None)
            self._logs = None
