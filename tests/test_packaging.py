import subprocess
import sys

from conftest import REPO_ROOT


def test_pip_install_makes_timm_ext_importable_elsewhere(tmp_path):
    # Install the project (no dependencies: they are already here) into an empty target folder, then import it
    # from a folder outside the repository, as someone's own timm script would.
    target = tmp_path / 'site'
    build = subprocess.run(
        [sys.executable, '-m', 'pip', 'install', '--quiet', '--no-deps', '--no-build-isolation', '--target',
         str(target), str(REPO_ROOT)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    probe = subprocess.run(
        [sys.executable, '-c', 'import timm_ext.lr, timm_ext.batch_decay; print(timm_ext.lr.__file__)'],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={'PYTHONPATH': str(target)})
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().startswith(str(target))
