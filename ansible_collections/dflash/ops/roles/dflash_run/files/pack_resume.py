"""Pack dflash-resume.pyz on the controller: the collection's module_utils and a __main__ that runs
run_resume, as one zip application the container's python3 runs (the standard library only).

Usage: pack_resume.py MODULE_UTILS_DIR OUTPUT

The archive's bytes depend on the sources alone (fixed timestamps, sorted entries), so an unchanged
collection gives an unchanged file and the copy to the container changes nothing. Written through a temp
file and a rename (plays may pack at once). Prints JSON {"path": OUTPUT, "sha256": ...}.
"""

import hashlib
import io
import json
import os
import sys
import tempfile
import zipfile

PACKAGE = "ansible_collections/dflash/ops/plugins/module_utils"
# The program: every run's outcome a JSON line on stdout (the journal), the directory of the start files
# its one argument.
MAIN = """import json
import sys

from ansible_collections.dflash.ops.plugins.module_utils.run_resume import resume_all

for result in resume_all(sys.argv[1] if len(sys.argv) > 1 else "/var/lib/dflash"):
    print(json.dumps(result, sort_keys=True), flush=True)
"""


def entry(name):
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def pack(module_utils_dir):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(entry("__main__.py"), MAIN)
        parts = PACKAGE.split("/")
        for depth in range(1, len(parts) + 1):  # zipimport finds a namespace package by its directory entry
            archive.writestr(entry("/".join(parts[:depth]) + "/"), b"")
        for name in sorted(os.listdir(module_utils_dir)):
            if name.endswith(".py"):
                with open(os.path.join(module_utils_dir, name), "rb") as source:
                    archive.writestr(entry(f"{PACKAGE}/{name}"), source.read())
    return buffer.getvalue()


def main(argv):
    module_utils_dir, output = argv[1], argv[2]
    data = pack(module_utils_dir)
    os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    try:
        with open(output, "rb") as existing:
            same = existing.read() == data
    except OSError:
        same = False
    if not same:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(output) or ".", prefix=".dflash-resume-")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, output)
    print(json.dumps({"path": output, "sha256": hashlib.sha256(data).hexdigest()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
