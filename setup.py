"""Only here to install the startup hook (llamafactory_mca.pth) into site-packages.

setuptools has no declarative way to place a file at the root of purelib: the build_py step copies it
beside the packages for regular wheels, and the editable_wheel step adds it to the editable wheel
(``pip install -e .``), so both install modes activate USE_MCA=1 and uninstall removes the hook.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel


HOOK = "llamafactory_mca.pth"


class BuildPyWithHook(build_py):
    def run(self):
        super().run()
        self.copy_file(HOOK, os.path.join(self.build_lib, HOOK))


class EditableWheelWithHook(editable_wheel):
    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(HOOK, os.path.join(installation_dir, HOOK))


setup(cmdclass={"build_py": BuildPyWithHook, "editable_wheel": EditableWheelWithHook})
