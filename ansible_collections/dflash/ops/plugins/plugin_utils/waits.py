# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one line a wait prints while it lasts (the dflash.ops.waits callback at each retry of a polled wait):
the host, what it waits for when that is known, and its last progress (the run's log's last line)."""

# A log line longer than this is cut: a wait's line is read by people.
MAX_PROGRESS = 240


def progress_line(host, progress, waiting_for=None):
    """What a wait of `host` says of itself: what it waits for (if given) and its last progress, one line."""
    text = " ".join(str(progress).split())
    if len(text) > MAX_PROGRESS:
        text = text[:MAX_PROGRESS - 3] + "..."
    what = f" for {' '.join(str(waiting_for).split())}" if waiting_for else ""
    return f"    {host}: still waiting{what}; last: {text}"
