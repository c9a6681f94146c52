# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations


class ModuleDocFragment:
    """The attributes every module of this collection shares; each module states its check_mode support."""

    DOCUMENTATION = r"""
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
  diff_mode:
    description:
      Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
    support: none
  platform:
    description: Target OS/families that can be operated against.
    support: N/A
    platforms: posix
"""

    # A module that only reads (extends_documentation_fragment: dflash.ops.attributes.read_only).
    READ_ONLY = r"""
attributes:
  check_mode:
    support: full
    details: Reads only, so it runs the same in check mode.
"""
