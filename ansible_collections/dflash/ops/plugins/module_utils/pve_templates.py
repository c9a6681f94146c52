# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container templates by name: what a node's appliance index offers (`pveam available`) and the newest
template of a name in it, so that an inventory names `debian-12-standard` and not a version that the
index drops once a newer one is out."""

from __future__ import annotations

import re

# pct create's template argument: <storage>:vztmpl/<file>.
TEMPLATE_VOLUME = re.compile(r"^([A-Za-z][A-Za-z0-9._-]*):vztmpl/([^/\s]+)$")
SECTION = "system"


def parse_pveam_available(output, section=SECTION):
    """The template files of one section in `pveam available` (pve-manager's PVE/CLI/pveam.pm:
    `%-15s %s` section and template, PVE 9 appending the architecture)."""
    return [row[1] for row in (line.split() for line in output.splitlines())
            if len(row) >= 2 and row[0] == section]


def template_version(file_name, name):
    """The version of a template file of `name` as numbers (`debian-12-standard_12.12-1_amd64.tar.zst`:
    (12, 12, 1)), None when the file is not one of `name`."""
    if not file_name.startswith(f"{name}_"):
        return None
    return tuple(int(part) for part in re.findall(r"[0-9]+", file_name[len(name) + 1:].split("_")[0]))


def newest(files, name):
    """The newest template file of `name` among `files`, None when there is none."""
    versions = [(template_version(f, name), f) for f in files]
    found = [pair for pair in versions if pair[0] is not None]
    return max(found)[1] if found else None


def index_names(tools):
    """(the system section's template files, None) from the node's `pveam available --section system`,
    or ([], what went wrong)."""
    answer = tools.tool("pveam", "available", "--section", SECTION)
    if answer.rc != 0:
        return [], f"pveam available --section {SECTION} fails: {(answer.stderr or answer.stdout).strip()}"
    return parse_pveam_available(answer.stdout), None


def resolve(tools, pinned, name, storage):
    """(the template volume to create from, the index's files, what went wrong or None): the pinned
    volume as it is, else the newest file of `name` in the index on `storage`."""
    files, error = index_names(tools)
    if pinned:
        return pinned, files, error
    if error:
        return None, files, error
    found = newest(files, name)
    if found is None:
        return None, files, (f"pveam available --section {SECTION} lists no {name} template (run pveam "
                             f"update; it lists: {', '.join(files) or 'nothing'})")
    return f"{storage}:vztmpl/{found}", files, None
