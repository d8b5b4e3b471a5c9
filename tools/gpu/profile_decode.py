"""Where a decode step's time goes: torch.profiler over a few steps of one model (GPU machine)."""
import sys

import torch

sys.path.insert(0, ".")
from strata.config import EngineConfig, ExpertConfig  # noqa: E402
from strata.engine.engine import Engine, Sequence  # noqa: E402
from strata.engine.loader import load_model  # noqa: E402
from strata.engine.sampler import SamplingParams  # noqa: E402

lm = load_model(sys.argv[1], EngineConfig(experts=ExpertConfig(mode="resident")))
eng = Engine(lm)
seq = Sequence(list(range(100, 612)), SamplingParams(temperature=0), 40, set())
eng.add(seq)
for _ in range(8):
    eng.step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
print(p.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
