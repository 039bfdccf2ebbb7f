"""Which process speaks for its machine. What every rank of a machine would print alike (an error all ranks hit,
a warning about shared files) is printed by the first rank of each machine only, so that each machine's log says
it once. Reads the launcher's environment alone: usable before torch is imported."""

from __future__ import annotations

import os


def first_on_machine() -> bool:
    """This process is its machine's first rank: LOCAL_RANK 0, unset or empty (a single process), or not a
    number (then it cannot know: it speaks)."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
    except ValueError:
        return True
