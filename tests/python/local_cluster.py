"""A local cluster for the Python tests: moectl cluster up in a temporary state
directory for the test class, down again after it. MOECTL names moectl."""
import os
import shutil
import subprocess
import tempfile
import unittest

MOECTL = os.environ.get("MOECTL", "moectl")


def moectl(state, *args):
    """moectl's stdout; AssertionError with its output when it fails."""
    out = subprocess.run([MOECTL, "--state-dir", state, *args], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"moectl {' '.join(args)}: {out.returncode}\n{out.stdout}{out.stderr}")
    return out.stdout


class LocalClusterTest(unittest.TestCase):
    """A test class with a cluster of NODES x DEVICES CPU devices in self.state."""
    NODES, DEVICES = 2, 2

    @classmethod
    def setUpClass(cls):
        cls.state = tempfile.mkdtemp(prefix="moed-python-")
        moectl(cls.state, "cluster", "up", "--nodes", str(cls.NODES), "--devices-per-node", str(cls.DEVICES),
               "--backend", "cpu")

    @classmethod
    def tearDownClass(cls):
        subprocess.run([MOECTL, "--state-dir", cls.state, "cluster", "down"], capture_output=True, timeout=120)
        shutil.rmtree(cls.state, ignore_errors=True)
