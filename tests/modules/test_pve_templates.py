"""The template by name (module_utils/pve_templates): `pveam available` in PVE 8's and PVE 9's formats
(pve-manager's PVE/CLI/pveam.pm), and the newest template of a name by its version's numbers."""

from __future__ import annotations

from ansible_collections.dflash.ops.plugins.module_utils import pve_templates

PVE8 = """\
mail            proxmox-mail-gateway-8.1-standard_8.1-1_amd64.tar.zst
system          debian-11-standard_11.7-1_amd64.tar.zst
system          debian-12-standard_12.7-1_amd64.tar.zst
system          debian-12-standard_12.12-1_amd64.tar.zst
system          debian-12-standardish_99.0-1_amd64.tar.zst
turnkeylinux    debian-12-turnkey-core_18.0-1_amd64.tar.gz
"""
PVE9 = ("system          debian-13-standard_13.1-2_amd64.tar.zst                       amd64\n"
        "system          ubuntu-24.04-standard_24.04-2_amd64.tar.zst                   amd64\n")


def test_available_lists_one_section_in_both_formats():
    assert pve_templates.parse_pveam_available(PVE8) == [
        "debian-11-standard_11.7-1_amd64.tar.zst", "debian-12-standard_12.7-1_amd64.tar.zst",
        "debian-12-standard_12.12-1_amd64.tar.zst", "debian-12-standardish_99.0-1_amd64.tar.zst"]
    assert pve_templates.parse_pveam_available(PVE8, "turnkeylinux") == [
        "debian-12-turnkey-core_18.0-1_amd64.tar.gz"]
    assert pve_templates.parse_pveam_available(PVE9) == [
        "debian-13-standard_13.1-2_amd64.tar.zst", "ubuntu-24.04-standard_24.04-2_amd64.tar.zst"]
    assert pve_templates.parse_pveam_available("400 Parameter verification failed.\n") == []


def test_the_newest_of_a_name_compares_versions_as_numbers_and_names_exactly():
    files = pve_templates.parse_pveam_available(PVE8)
    # 12.12-1 is newer than 12.7-1 (as text it sorts first); debian-12-standardish is another name.
    assert pve_templates.newest(files, "debian-12-standard") == "debian-12-standard_12.12-1_amd64.tar.zst"
    assert pve_templates.newest(files, "debian-11-standard") == "debian-11-standard_11.7-1_amd64.tar.zst"
    assert pve_templates.newest(files, "debian-13-standard") is None
    assert pve_templates.template_version("debian-12-standard_12.12-1_amd64.tar.zst", "debian-12-standard") \
        == (12, 12, 1)
