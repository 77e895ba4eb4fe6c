"""The benchmarks behind ``python scripts/benchmark.py <subcommand>`` (scripts/benchmark.py parses the command line
and calls one ``bench_*`` function of these modules):

* ``common``      -- paths, timing, the PyTorch peer's runner, memory readings, the host's GEMM calibration
* ``graphs``      -- graphs: graph construction (and vesin's neighbour search, when installed)
* ``model``       -- model: inference and training steps against PyTorch orb-models, the matrix-multiply bound
* ``matmul``      -- gemm, breakdown: MindSpore's matrix products against BLAS, a step's time by product kind
* ``parallel``    -- parallel, allreduce, pipeline: data parallel, gradient all-reduce, the host data pipeline
* ``calculator``  -- calculator: the ASE calculator against orb-models' ORBCalculator
* ``mptrj``       -- MPtrj-like databases (rotated copies of the shipped rows; MPtrj-sized, cached)
* ``formats``     -- counts, rows, formats: neighbour counts, row reads, extxyz against SQLite
* ``scale``       -- scale: start-up at MPtrj's size
* ``relax``       -- relax: batched relaxation against ASE's FIRE loop
* ``save``        -- save: a training checkpoint at a model's full size
* ``precision``   -- precision: each precision mode against float64 (and PyTorch's bf16 autocast), demos per mode
* ``md``          -- md: orb-md against ASE's VelocityVerlet driving the calculator structure by structure
* ``restart``     -- restart: compilation on a first start, a second start and a resume, with the compile cache
* ``suite``       -- suite: the README's test command, timed as CI runs it, and where its time goes
* ``compile_options``, ``compile_ops``, ``compile_memory`` -- compile-options, compile-ops, compile-memory: what a
  compilation costs (MindSpore's options, per operation and model part) and what a process keeps of each graph
* ``cell_call``   -- cell-call: what a compiled prediction's call costs besides running its graph
* ``command_gc``  -- command-gc: Python's garbage collector in a short command
* ``dynamic_shape`` -- dynamic-shape: the calculator's one prediction graph for every size against a graph per shape
* ``sums``        -- run by path: sums that grow with the structure, in float32 ulps

Programs the benchmarks run in processes of their own are files, run by path:

* ``children/`` -- with this interpreter and the project (``orb``): ``model_ours.py`` (one model measurement,
  fresh process), ``allreduce_worker.py`` (one msrun worker), ``read_rows.py`` (one reader's row reads),
  ``scale_first_step.py`` (``finetune.py`` stopped at its first training step), ``dynamic_shape.py`` (one mode of
  dynamic-shape), and the other subcommands' own (``compile_*.py``, ``calculator_first_call.py``,
  ``restart_callback.py``, ``suite_trace/``)
* ``peer/`` -- with the PyTorch interpreter (``--torch-python``), which has torch, orb-models and their
  dependencies only: self-contained, they import neither ``orb`` nor this package, take their inputs as
  arguments and print one JSON line: ``torch_graphs.py``, ``torch_steps.py``, ``torch_calculator.py``
  (``torch_builders.py``: the models and graphs they share)
"""
