"""Test hook: at after_step of step 4, rank 0 deletes the run's MLflow run (a tracker that goes away mid-run:
every later MLflow call raises), after waiting until MLflow holds step 3."""
import json
import os
import time

from spmdrl.hooks import hook


@hook("after_step")
def break_mlflow(ctx):
    if ctx.step != 4 or ctx.mesh.rank != 0:
        return
    from mlflow.tracking import MlflowClient

    with open(os.path.join(ctx.config.trainer.output_dir, "trackers.json")) as f:
        ids = json.load(f)["mlflow"]
    client = MlflowClient(tracking_uri=ids["tracking_uri"])
    deadline = time.monotonic() + 60
    while not any(m.step == 3 for m in client.get_metric_history(ids["run_id"], "train/reward_mean")):
        assert time.monotonic() < deadline, "MLflow never got step 3"
        time.sleep(0.2)
    client.delete_run(ids["run_id"])
