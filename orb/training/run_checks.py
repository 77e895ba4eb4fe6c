"""What a run's config is checked against beyond its own values (:mod:`orb.training.config`): the data it names
exists, and it fits the job's workers. Run by orb-finetune, by each data-parallel worker, and by the data-parallel
launcher before msrun starts them."""

from orb.errors import ConfigError, DatasetError
from orb.training.config import TrainConfig


def check_training_data(cfg: TrainConfig) -> None:
    """A run trains on data it names, and every path it names exists; a config read for its model alone (the
    calculator, a test) needs none."""
    if not cfg.train_data_path:
        raise ConfigError("config key 'train_data_path' is not set: name your training data (extxyz or any ase.io "
                          "file, an ASE database, .aselmdb, a folder, or a list of these)")
    from orb.data.formats import source_files

    for key, path in (("train_data_path", cfg.train_data_path), ("val_data_path", cfg.val_data_path),
                      ("replay.data_path", cfg.replay.data_path), ("replay.val_data_path", cfg.replay.val_data_path)):
        try:
            if path:
                source_files(path)  # one that does not exist is said now, before published weights are downloaded
        except DatasetError as exc:
            raise ConfigError(f"config key '{key}': {exc}") from None


def check_job_size(cfg: TrainConfig, world_size: int) -> None:
    """The values that must fit the job's number of workers: checked by the data-parallel launcher before msrun
    starts them (rank 0's log stayed empty while rank 1 said it), and by each worker."""
    if cfg.batch_size < world_size:
        raise ConfigError(f"config key 'batch_size' ({cfg.batch_size}) is the global batch and must be at least "
                          f"the number of workers ({world_size})")
