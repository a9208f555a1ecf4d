import pytest
from harness import assert_bit_identical
from test_fault_tolerance import GATES, start_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

@pytest.mark.parametrize("extra", [["--data-parallel=fsdp", "--fsdp-wrap=Linear", "--async-quorum=0"], []])
def test_probe(launch, extra):
    job = launch(groups=2, nproc_per_group=2, worker_args=["--max-steps=12", "--unused-bias-at-step=6", "--unused-bias-groups=1", *extra, *GATES])
    start_together(job, groups=2, nproc=2)
    code = job.wait_exit()
    assert code == 0, job.tail()
    assert all(record["participants"] == 2 for record in job.events("step", committed=True)), "a group sat out"
    states = job.final_states()
    for k, s in states.items():
        print(k, s["global_step"], s["manager_step"])
    assert_bit_identical(states, 2)
