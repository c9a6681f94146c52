"""The dflash.ops collection's package metadata says one thing everywhere (no sim needed): one version
for the collection, its changelog and the Python package; one license; community.proxmox in one tested
range; the pct modules as one action group; each checkout playbook a wrapper of the collection's own.
Building and installing the collection, and a deploy from it: test_installed_collection.py."""

import json
import re
import subprocess
import tomllib
from pathlib import Path

import yaml
from ansible.galaxy.dependency_resolution.versioning import meets_requirements
from ansible.module_utils.ansible_release import __version__ as ANSIBLE_CORE
from packaging.specifiers import SpecifierSet

from pvesim.fleet import REPO, VENV_BIN

COLLECTION = REPO / "ansible_collections" / "dflash" / "ops"
GALAXY = yaml.safe_load((COLLECTION / "galaxy.yml").read_text())
RUNTIME = yaml.safe_load((COLLECTION / "meta" / "runtime.yml").read_text())
CHANGELOG = yaml.safe_load((COLLECTION / "changelogs" / "changelog.yaml").read_text())
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# A plugin's documented version_added (the connection's is unquoted YAML, the others' quoted).
VERSION_ADDED = re.compile(r'^version_added: "?([0-9][0-9.]*)"?$', re.MULTILINE)
PLUGIN_KINDS = ("modules", "callback", "connection", "filter", "lookup", "inventory", "test", "become")


def latest_release():
    return max(CHANGELOG["releases"], key=lambda v: tuple(int(p) for p in v.split(".")))


def test_one_version_for_the_collection_its_changelog_and_the_python_package():
    assert GALAXY["version"] == PROJECT["version"] == latest_release(), (
        GALAXY["version"], PROJECT["version"], latest_release())


def test_every_plugin_is_new_in_a_release_of_the_changelog_that_lists_it():
    """version_added names a release of changelogs/changelog.yaml, and that release lists the plugin
    as new (`antsibull-changelog release` builds the list from version_added)."""
    missing = []
    for kind in PLUGIN_KINDS:
        for path in sorted((COLLECTION / "plugins" / kind).glob("*.py")):
            found = VERSION_ADDED.search(path.read_text())
            if path.name == "__init__.py" or (kind != "modules" and not found):
                continue  # filter/test files without documentation hold no plugin of their own
            assert found, f"{path.relative_to(COLLECTION)} documents no version_added"
            release = CHANGELOG["releases"].get(found.group(1))
            listed = (release or {}).get("modules" if kind == "modules" else "plugins", {})
            if kind != "modules":
                listed = listed.get(kind, [])
            if path.stem not in {entry["name"] for entry in listed}:
                missing.append(f"{kind}/{path.stem} (version_added {found.group(1)})")
    assert not missing, ("not listed as new in its release of changelogs/changelog.yaml: "
                         f"{missing}; rerun antsibull-changelog in the collection")


def test_the_changelog_and_its_fragments_lint_clean():
    for args in (["lint"], ["lint-changelog-yaml", "changelogs/changelog.yaml"]):
        res = subprocess.run([str(VENV_BIN / "antsibull-changelog"), *args], cwd=COLLECTION,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and not res.stdout.strip(), (args, res.stdout, res.stderr)


def test_one_license_everywhere_with_its_full_text():
    """galaxy.yml, pyproject.toml, every role's meta and every plugin's header name one license, and the
    collection ships its full text (the repository's LICENSE)."""
    assert GALAXY["license"] == [PROJECT["license"]] == ["GPL-3.0-or-later"]
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:5] == ["GNU", "GENERAL", "PUBLIC", "LICENSE", "Version"] and "Version 3" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a pointer to it
    assert (COLLECTION / "LICENSE").read_text() == text
    roles = {p.parent.parent.name: yaml.safe_load(p.read_text())["galaxy_info"]["license"]
             for p in COLLECTION.glob("roles/*/meta/main.yml")}
    assert set(roles.values()) == {"GPL-3.0-or-later"}, roles
    headers = [p.relative_to(COLLECTION).as_posix() for p in COLLECTION.glob("plugins/**/*.py")
               if p.name != "__init__.py" and "GNU General Public License v3.0+" not in p.read_text()[:400]]
    assert not headers, f"without the license header: {headers}"


def test_community_proxmox_is_pinned_to_one_bounded_range_that_the_bundled_release_meets():
    """pct_pipelined relies on proxmox_pct_remote's internals: the range has an upper bound, galaxy.yml
    and requirements.yml agree on it, and the release the pinned `ansible` package bundles is in it."""
    pin = GALAXY["dependencies"]["community.proxmox"]
    assert "<" in pin, pin
    requirements = yaml.safe_load((REPO / "requirements.yml").read_text())["collections"]
    assert requirements == [{"name": "community.proxmox", "version": pin}], requirements
    import ansible_collections.community.proxmox as bundled

    manifest = json.loads((Path(bundled.__path__[0]) / "MANIFEST.json").read_text())
    assert meets_requirements(manifest["collection_info"]["version"], pin), (manifest["collection_info"], pin)


def test_requires_ansible_admits_the_pinned_ansible_core():
    required = RUNTIME["requires_ansible"]
    assert ANSIBLE_CORE in SpecifierSet(required), (ANSIBLE_CORE, required)


def test_the_pct_action_group_is_the_modules_that_run_pct_and_each_says_so():
    """meta/runtime.yml's group `pct` is exactly the modules built on the dflash.ops.pct options, and
    their documentation (the fragment) names the group, as module_defaults' group/dflash.ops.pct uses it."""
    group = RUNTIME["action_groups"]["pct"]
    pct_modules = sorted(p.stem for p in (COLLECTION / "plugins" / "modules").glob("*.py")
                         if re.search(r"^  - dflash\.ops\.pct$", p.read_text(), re.MULTILINE))
    assert sorted(group) == pct_modules, (group, pct_modules)
    fragment = (COLLECTION / "plugins" / "doc_fragments" / "pct.py").read_text()
    docs = yaml.safe_load(fragment.split('DOCUMENTATION = r"""', 1)[1].split('"""', 1)[0])
    assert docs["attributes"]["action_group"]["membership"] == ["dflash.ops.pct"]


def test_each_checkout_playbook_runs_the_collections_playbook_of_its_name():
    """playbooks/<name>.yml imports dflash.ops.<name> and nothing else; the collection has a playbook
    for each, and the checkout a wrapper for each of the collection's."""
    wrappers = sorted(p.stem for p in (REPO / "playbooks").glob("*.yml"))
    assert wrappers == sorted(p.stem for p in (COLLECTION / "playbooks").glob("*.yml"))
    for name in wrappers:
        [play] = yaml.safe_load((REPO / "playbooks" / f"{name}.yml").read_text())
        assert play.get("ansible.builtin.import_playbook") == f"dflash.ops.{name}", play
        assert set(play) == {"name", "ansible.builtin.import_playbook"}, play
