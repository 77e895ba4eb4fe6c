"""Fine-tune orb on one device:  python finetune.py --config configs/finetune_orb_v3.yaml [--key value ...]
(installed: orb-finetune --config finetune_orb_v3 ...; --help lists the options and the packaged templates).

``finetune_parallel.py`` is the same run made data-parallel; diff the two to see what that adds.
"""

from orb.signals import listen, run_program

with listen().exit_on_stop():  # the imports take 0.3 s and more on a cold shared file system: a stop there exits 75
    from orb.training.cli import run
    from orb.device import configure_mindspore
    from orb.training.outputs import prepare_output_dir, setup_logging
    from orb.files import sole_writer


def fine_tune(cfg, args) -> None:
    configure_mindspore(cfg.device_target, cfg.device_id, cfg.num_threads, precision=cfg.precision,
                        deterministic=cfg.deterministic)
    with sole_writer(cfg.output_dir, "output_dir"):  # the same job submitted twice: the second is refused
        prepare_output_dir(cfg.output_dir, resume=bool(args.resume), overwrite=args.overwrite)
        setup_logging(cfg.output_dir)

        from orb.training.setup import build_trainer

        build_trainer(cfg, resume=args.resume or None, accept_config_changes=args.accept_config_changes).fit()


def main(argv=None) -> int:
    return run(argv, None, fine_tune)  # --config is required


if __name__ == "__main__":
    run_program(main)
