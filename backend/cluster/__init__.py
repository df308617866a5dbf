"""Running a Config beyond one machine, through existing engines (no torch imported here).

* :mod:`backend.cluster.slurm` — an sbatch script (one torchrun per node via srun, c10d
  rendezvous at the head node, the job id as rendezvous id), submitted with sbatch, followed
  with scontrol (sacct where accounting exists), cancelled with scancel.
* :mod:`backend.cluster.hosts` — plain multi-node torchrun: the exact command for each host
  (the user starts them), then the run directory is followed.
* :mod:`backend.cluster.rank` — the per-rank entry point on a node: records which node the
  rank ran on, then hands over to :mod:`backend.worker`.

Both targets need the run directory on a filesystem every node shares: the ranks write
their events and measurements there (backend.records layout) and this process reads them,
exactly as for a local run, so ``measurement.json`` and ``shardscope compare`` are the same.
"""

from backend.cluster.follow import ClusterError, ClusterRun, cluster_run_cli, node_layout

__all__ = ["ClusterError", "ClusterRun", "cluster_run_cli", "node_layout"]
