"""Each sim's host keys in its own marked block of the system known_hosts (what paramiko reads)."""

from pvesim import host


def test_blocks_are_added_replaced_and_removed_leaving_other_lines(tmp_path, monkeypatch):
    path = tmp_path / "ssh_known_hosts"
    monkeypatch.setattr(host, "SYSTEM_KNOWN_HOSTS", path)
    path.write_text("github.com ssh-ed25519 AAAAkeep\n"
                    "# BEGIN pvesim /dead/sim\n[127.0.0.2]:5555 ssh-ed25519 AAAAstale\n"
                    "[127.0.0.2]:6666 ssh-ed25519 AAAAother\n# END pvesim /dead/sim\n")

    host.set_system_known_hosts("/live/sim", ["[127.0.0.2]:5555 ssh-ed25519 AAAAnew"])
    host.set_system_known_hosts("/live/sim", ["[127.0.0.2]:5555 ssh-ed25519 AAAAnew"])  # idempotent

    text = path.read_text()
    assert "AAAAstale" not in text  # the port is this sim's now: a stale key for it must go
    assert text.count("AAAAnew") == 1 and "AAAAkeep" in text and "AAAAother" in text
    host.remove_system_known_hosts("/live/sim")
    assert path.read_text() == ("github.com ssh-ed25519 AAAAkeep\n# BEGIN pvesim /dead/sim\n"
                                "[127.0.0.2]:6666 ssh-ed25519 AAAAother\n# END pvesim /dead/sim\n")
