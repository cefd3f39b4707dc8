"""The `k3` command: `k3 info` prints the configuration audit (SPEC §0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from k3.cli import main
from k3.config import preset


def test_info_paper_prints_the_audit(capsys):
    assert main(["info", "--preset", "paper"]) == 0
    out = capsys.readouterr().out
    for expected in ("93 = 69 KDA + 24 MLA", "4, 8, 12", "92, 93", "576 scalars", "30,720 scalars; ratio 53 1/3",
                     "9 = embedding + 7 complete blocks + 1 partial (9 layers)", "1/56 = 1.79%",
                     "2.78T", "104.2B", "assumed (not published)"):
        assert expected in out, expected


def test_info_json_and_config_file(tmp_path, capsys):
    path = tmp_path / "small.json"
    preset("small").save(path)
    assert main(["info", "--config", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layers"] == 8 and data["published"] is None


def test_info_bad_config_exits_2_naming_the_field(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"moe": {"num_experts": 4, "num_experts_per_token": 9}}))
    assert main(["info", "--config", str(path)]) == 2
    assert "config.moe.num_experts_per_token = 9" in capsys.readouterr().err


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("k3")
    result = subprocess.run([str(script), "info", "--preset", "tiny"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "4 = 3 KDA + 1 MLA" in result.stdout
