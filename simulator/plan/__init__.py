"""Capacity planning (``simulate plan PLAN.yaml -o DIR``): which deployment serves the target
traffic within the SLOs most cheaply.

- :mod:`.spec`: the plan file and the candidates of its search space;
- :mod:`.slo`: the SLO verdict of one simulated point;
- :mod:`.search`: the per-seed rate search and capacity intervals;
- :mod:`.cost`: sizing, prices, the Pareto set;
- :mod:`.point`: one simulated probe (runs in workers);
- :mod:`.runner`: the adaptive search over points on the experiment core (``run_plan``; not
  imported here, so that reading plan results never loads the executors);
- :mod:`.summary`: ranking, fit verdicts, ``plan.csv`` / ``plan.json``.

Rendering of plan results (tables, report.md/html) lives in ``reports/plan.py``.
Units: request rates in req/s, latencies in ms (as in the vLLM bench schema), money in USD.
"""

from servesim.simulator.plan.cost import deployment_cost, load_prices, pareto_mask
from servesim.simulator.plan.search import RateSearch, capacity_interval, search_capacity
from servesim.simulator.plan.slo import point_metrics, queue_growth, slo_passed, slo_ratio
from servesim.simulator.plan.spec import PlanSLO, PlanSpec, PlanTolerance, load_plan

__all__ = ["PlanSLO", "PlanSpec", "PlanTolerance", "RateSearch", "capacity_interval",
           "deployment_cost", "load_plan", "load_prices", "pareto_mask", "point_metrics",
           "queue_growth", "search_capacity", "slo_passed", "slo_ratio"]
