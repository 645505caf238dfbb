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


def test_readme_config_overview_is_a_valid_config():
    """"The config in two minutes" lists every section with its defaults: it validates and
    resolves, and each key it shows at vLLM's default resolves to the value it claims."""
    import yaml
    from servesim.simulator.config import resolve_config, validate_tree

    text = README.read_text()
    block = text[text.index("## The config in two minutes"):].split("```yaml")[1].split("```")[0]
    cfg = resolve_config(validate_tree(yaml.safe_load(block), "README.md"))
    assert (cfg.model.max_model_len, cfg.cache.gpu_memory_utilization, cfg.cache.block_size,
            cfg.optimization_level, cfg.cpu_offload_gb) == (8192, 0.92, 16, 2, 0.0)
    assert cfg.compilation.cudagraph_mode == "FULL_AND_PIECEWISE"
