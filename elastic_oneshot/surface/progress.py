"""The per-layer progress bar with ETA: rank 0 draws it, the other ranks stay quiet."""

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

_open: list["LayerBar"] = []


def close_all():
    """End every bar still drawn, so that an error line that follows starts on a line of its own."""
    for bar in list(_open):
        bar.close()


class LayerBar:
    """One tick per committed layer, drawn from its first call (the layer loop's progress callback): layers
    committed before this process started count as done, not as speed. While it is drawn, log lines print above it
    instead of through it."""

    def __init__(self, show: bool):
        self.show, self.bar, self._logs = show, None, None

    def __call__(self, done: int, total: int):
        """`done` of `total` layers committed now (a redone layer does not move the bar)."""
        if self.bar is None:
            self.bar = tqdm(total=total, initial=done, desc="layers", unit="layer", disable=not self.show,
                            dynamic_ncols=True)
            self._logs = logging_redirect_tqdm() if self.show and done < total else None
            if self._logs:
                self._logs.__enter__()
            _open.append(self)
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        if done >= self.bar.total:
            self.close()

    def close(self):
        if self in _open:
            _open.remove(self)
        if self.bar is not None:
            self.bar.close()
        if self._logs:
            self._logs.__exit__(None, None, None)
            self._logs = None
