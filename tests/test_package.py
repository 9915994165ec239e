import subprocess
import sys


def test_import_tmac_is_light():
    code = "import sys, tmac; bad = [m for m in ('tvm', 'torch') if m in sys.modules]; print(bad); assert not bad"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_subpackages_map_to_top_level_folders():
    import tmac.codegen
    import tmac.kernels
    import tmac.models

    for mod, folder in ((tmac.codegen, "codegen"), (tmac.kernels, "kernels"), (tmac.models, "models")):
        assert mod.__file__.replace("\\", "/").split("/")[-2] == folder
