import sys, json
sys.path.insert(0, "benchmarks")
import build_time
from mlx_lily import patching
mode = sys.argv[1]
if mode == "full":
    patching._start_tracking = lambda: None
print(json.dumps(build_time.measure(40, 200, 10, "1")))
