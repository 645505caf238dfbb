"""The README's "write your own policy" example runs and changes decisions."""

import re
from pathlib import Path

from harness import Harness
from servesim.simulator import registry
from servesim.simulator.scheduler import SchedulerParams

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_policy_example():
    text = README.read_text()
    section = text[text.index("## Write your own policy"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102  (our own README)
    factory = registry.get_scheduler("lifo")
    assert factory is namespace["LIFOScheduler"]

    h = Harness(max_num_seqs=1)
    params = SchedulerParams(max_num_seqs=1, max_num_batched_tokens=2048, max_model_len=4096,
                             block_size=16, policy="lifo")
    h.sched = factory(params, h.kv, record_schedules=True)
    for rid in ("first", "second", "third"):
        h.add(rid, 8, 2)
    order = []
    for step in h.run():
        for rid in step:
            if rid not in order:
                order.append(rid)
    assert order == ["third", "second", "first"]
