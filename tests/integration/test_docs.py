"""The docs site: the generated pages are what the code generates now (edit the models
or the README, then ``make docs``), the site builds with ``mkdocs build --strict`` (a
broken link or a page outside the nav fails), and the README stays short."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hicache.integration.docs.reference import generated_pages

ROOT = Path(__file__).resolve().parents[2]


def test_generated_pages_are_up_to_date():
    stale = [str(path.relative_to(ROOT)) for path, text in generated_pages(ROOT / "docs").items()
             if not path.exists() or path.read_text() != text.rstrip() + "\n"]
    assert stale == [], f"run `make docs` and commit: {stale}"


def test_the_reference_lists_every_config_key_with_its_allowed_values():
    from hicache.tiers.config import HiCacheConfig

    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    for key in HiCacheConfig.model_fields:
        assert f"| `{key}` |" in page, key
    assert '`"write_through"`, `"write_through_selective"`, `"write_back"`' in page


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "admin-api" / "index.html").exists()


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
