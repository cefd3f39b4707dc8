"""k3.train.threads: torch's thread count follows the cores other processes leave free (issue 10, item 8)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from k3.train.threads import CoreShare, busy_cores


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_core_share_gives_a_busy_process_its_core_and_takes_it_back(restore_threads):
    idle_load = busy_cores(0.5)
    if idle_load is None:
        pytest.skip("no /proc/stat on this system")
    share = CoreShare(window_s=1.0)
    if idle_load > share.cores - 1:  # another process already fills the machine: a busy loop cannot show
        pytest.skip(f"the machine is busy ({idle_load:.1f} of {share.cores} cores in use by other processes)")
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.2)
        threads = share.update()
        assert share.others >= idle_load + 0.7  # the busy loop's core is seen
        assert threads == torch.get_num_threads() == max(1, share.cores - 1 - round(idle_load))
    finally:
        loop.kill()
        loop.wait()
    time.sleep(1.2)
    assert share.update() == torch.get_num_threads() == max(1, share.cores - round(idle_load))


def test_core_share_waits_for_a_full_window(restore_threads):
    share = CoreShare(window_s=60.0)
    before = torch.get_num_threads()
    assert share.update() == before == torch.get_num_threads()


def test_threads_flag_and_config_are_validated(tmp_path):
    from k3.train.pretrain import TrainConfig

    with pytest.raises(ValueError, match="train.threads"):
        TrainConfig(out=str(tmp_path), threads=0).validate()
