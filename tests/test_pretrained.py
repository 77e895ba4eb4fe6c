"""Published weights by name (orb.pretrained, orb-download): fetched from a local HTTP server this test starts (or a
file:// folder) laid out as orb-models' host, serving files made from the recipe weights."""

import http.server
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import DATA, MPTRJ_DB, ROOT


class Mirror(http.server.ThreadingHTTPServer):
    """orb-models' host on 127.0.0.1: ``files`` by URL path, range requests answered (206), ``cut`` bytes sent of the
    next ``cuts`` responses before the connection is closed; ``requests`` counts every request."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), MirrorHandler)
        self.files, self.requests, self.cut, self.cuts, self.ranges = {}, 0, 0, 0, []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class MirrorHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        server = self.server
        server.requests += 1
        body = server.files.get(self.path)
        if body is None:
            self.send_error(404, "Not Found")
            return
        start = 0
        if self.headers.get("Range"):
            start = int(self.headers["Range"].split("=")[1].rstrip("-"))
            server.ranges.append(start)
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        if server.cuts:
            server.cuts -= 1
            self.wfile.write(body[start:start + server.cut])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body[start:])


@pytest.fixture
def mirror(monkeypatch, tmp_path):
    server = Mirror()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("ORB_WEIGHTS_URL", server.url)
    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    yield server
    server.shutdown()
    server.server_close()


def recipe_file(name: str, folder) -> str:
    """A PyTorch file of ``name``'s architecture holding the recipe weights (what the mirror serves for it)."""
    from orb.io.torch_format import write_torch_checkpoint
    from orb.models import create
    from orb.models.recipe import model_recipe_weights

    path = os.path.join(str(folder), f"{name}.ckpt")
    write_torch_checkpoint(model_recipe_weights(create(name), seed=3), path)
    return path


def serve(mirror, name: str, path: str) -> bytes:
    from orb.pretrained import PUBLISHED

    with open(path, "rb") as f:
        body = f.read()
    mirror.files["/" + PUBLISHED[name]] = body
    return body


def unreachable(monkeypatch):
    """No network from now on: a mirror nothing listens at."""
    from orb.files import free_port

    monkeypatch.setenv("ORB_WEIGHTS_URL", f"http://127.0.0.1:{free_port()}")


def test_every_model_name_is_orb_models_published_file():
    """The table is orb-models' own: every name of MODEL_NAMES, at the address its loader in orb-models 0.5.5's
    pretrained.py downloads (read from the PyTorch peer's installed package, which CI provides)."""
    from orb.models.config import MODEL_NAMES
    from orb.pretrained import ORB_MODELS_HOST, PUBLISHED

    assert set(PUBLISHED) == set(MODEL_NAMES)
    peer = os.environ.get("ORB_TORCH_V3_PYTHON", "")
    if not peer:
        pytest.skip("ORB_TORCH_V3_PYTHON (a python with torch and orb-models 0.5.5) is not set; .ci/run sets it")
    script = ("import inspect, json\nfrom orb_models.forcefield import pretrained\n"
              "print(json.dumps({n: inspect.signature(getattr(pretrained, n)).parameters['weights_path'].default "
              f"for n in {sorted(PUBLISHED)!r}}}))")
    result = subprocess.run([peer, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    assert theirs == {name: f"{ORB_MODELS_HOST}/{path}" for name, path in PUBLISHED.items()}


def test_download_once_then_never_the_network(mirror, tmp_path, monkeypatch):
    """The first use downloads, verifies and records the file; later uses read the cache with the network gone, under
    orb-models' names and the file's own name too."""
    from orb import pretrained

    body = serve(mirror, "orb_v2", os.path.join(DATA, "torch_format_sample.ckpt"))
    path = pretrained.fetch("orb_v2", progress=False)
    assert path == str(tmp_path / "cache" / "weights" / "orb-v2-20241011.ckpt")
    assert open(path, "rb").read() == body and mirror.requests == 1
    record = pretrained.read_record(path)
    assert record["size"] == len(body) and record["url"] == f"{mirror.url}/forcefields/orb-v2-20241011.ckpt"
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".part")]
    unreachable(monkeypatch)
    for spelling in ("orb_v2", "orb-v2", "orb-v2-20241011.ckpt"):
        assert pretrained.fetch(pretrained.require_name(spelling)) == path
    assert mirror.requests == 1


def test_a_cut_connection_continues_where_it_stopped(mirror):
    """The server closes the connection twice after 40 kB: the download continues with range requests from where
    each stopped and ends with the whole file."""
    from orb import pretrained

    body = serve(mirror, "orb_v2", os.path.join(DATA, "torch_format_sample.ckpt"))
    mirror.cut, mirror.cuts = 40_000, 2
    path = pretrained.fetch("orb_v2", progress=False)
    assert open(path, "rb").read() == body
    assert mirror.ranges == [40_000, 80_000]


def test_a_killed_download_is_continued_by_the_next_process(mirror, tmp_path):
    """A download killed halfway leaves its .part; the next process asks only for the rest."""
    from orb import pretrained

    body = serve(mirror, "orb_v2", os.path.join(DATA, "torch_format_sample.ckpt"))
    folder = tmp_path / "cache" / "weights"
    folder.mkdir(parents=True)
    (folder / "orb-v2-20241011.ckpt.part").write_bytes(body[:100_000])
    assert open(pretrained.fetch("orb_v2", progress=False), "rb").read() == body
    assert mirror.ranges == [100_000]


def test_damaged_files_are_never_loaded(mirror, tmp_path, monkeypatch):
    """A download that is not the file it claims (a damaged zip) is removed and named; a cached file changed on disk
    no longer matches its record's sha256: it is removed and fetched again; never loaded."""
    from orb import pretrained

    body = serve(mirror, "orb_v2", os.path.join(DATA, "torch_format_sample.ckpt"))
    damaged = bytearray(body)
    damaged[len(body) // 2] ^= 0xFF
    mirror.files["/forcefields/orb-v2-20241011.ckpt"] = bytes(damaged)
    with pytest.raises(pretrained.DownloadError, match=r"the file downloaded from .* is damaged \(.*\) and was removed"):
        pretrained.fetch("orb_v2", progress=False)
    assert not os.listdir(tmp_path / "cache" / "weights") or all(
        n.startswith(".") for n in os.listdir(tmp_path / "cache" / "weights"))
    mirror.files["/forcefields/orb-v2-20241011.ckpt"] = body
    path = pretrained.fetch("orb_v2", progress=False)
    with open(path, "r+b") as f:  # the shared file system flips a byte of the cached copy
        f.seek(len(body) // 3)
        f.write(b"\x00")
    assert pretrained.fetch("orb_v2", progress=False) == path
    assert open(path, "rb").read() == body and mirror.requests == 3


def test_http_errors_no_network_and_unknown_names_are_one_line(mirror, monkeypatch, tmp_path):
    from orb import pretrained
    from orb.errors import CheckpointError, ConfigError

    with pytest.raises(pretrained.DownloadError, match=r"orb_v2: HTTP 404 Not Found from http://127\.0\.0\.1:\d+/"
                       r"forcefields/orb-v2-20241011\.ckpt \(ORB_WEIGHTS_URL="):
        pretrained.fetch("orb_v2")
    unreachable(monkeypatch)
    with pytest.raises(pretrained.DownloadError, match=r"cannot reach http://127.0.0.1:\d+/forcefields/orb-v2.*"
                       r"run `orb-download orb_v2` with ORB_CACHE_DIR"):
        pretrained.fetch("orb_v2")
    with pytest.raises(CheckpointError, match=r"unknown model name 'orb_v3_conservative_inf_omatt' \(did you mean "
                       r"orb_v3_conservative_inf_omat\?\); published names: orb_v2, "):
        pretrained.require_name("orb_v3_conservative_inf_omatt")
    monkeypatch.setenv("ORB_WEIGHTS_URL", "ftp://mirror")  # (a setting's mistake: exit 2, as bad input; it was 1)
    with pytest.raises(ConfigError, match="must start with http://, https:// or file://"):
        pretrained.fetch("orb_v2")
    assert not (tmp_path / "cache" / "weights" / "orb-v2-20241011.ckpt.part").exists()


def test_a_file_url_folder_serves_every_name(monkeypatch, tmp_path):
    """ORB_WEIGHTS_URL=file:///folder laid out as orb-models' host: a shared folder serves the names."""
    from orb import pretrained

    folder = tmp_path / "mirror" / "forcefields" / "orb-v3"
    folder.mkdir(parents=True)
    body = open(os.path.join(DATA, "torch_format_sample.ckpt"), "rb").read()
    (folder / "orb-v3-direct-20-omat-20250404.ckpt").write_bytes(body)
    monkeypatch.setenv("ORB_WEIGHTS_URL", (tmp_path / "mirror").as_uri())
    monkeypatch.setenv("ORB_CACHE_DIR", str(tmp_path / "cache"))
    path = pretrained.fetch("orb_v3_direct_20_omat", progress=False)
    assert open(path, "rb").read() == body
    with pytest.raises(pretrained.DownloadError, match=r"^orb_v2: file://.*orb-v2-20241011.ckpt is not in the mirror "
                                                        r"folder \(.*\); put orb-models' file there"):
        pretrained.fetch("orb_v2")


def test_a_read_only_cache_is_read_and_said_where_else_it_looked(mirror, monkeypatch, tmp_path, small_disk):
    """A cache another machine filled, mounted read-only here: its files are used; a name it lacks is downloaded into
    the per-user fallback; with neither writable, one line says where it looked."""
    from orb import pretrained

    shared = small_disk(4 << 20)
    monkeypatch.setenv("ORB_CACHE_DIR", str(shared))
    body = serve(mirror, "orb_v2", os.path.join(DATA, "torch_format_sample.ckpt"))
    serve(mirror, "orb_d3_v2", os.path.join(DATA, "torch_format_sample.ckpt"))
    first = pretrained.fetch("orb_v2", progress=False)
    assert subprocess.run(["mount", "-o", "remount,ro", str(shared)]).returncode == 0
    unreachable(monkeypatch)
    assert pretrained.fetch("orb_v2") == first
    monkeypatch.setenv("ORB_WEIGHTS_URL", mirror.url)
    other = pretrained.fetch("orb_d3_v2", progress=False)
    assert other.startswith(str(tmp_path / "tmp")) and open(other, "rb").read() == body
    monkeypatch.setenv("TMPDIR", str(shared / "tmp"))
    with pytest.raises(pretrained.DownloadError, match=f"orb_mptraj_only_v2: no cached copy and no writable cache "
                       f"folder to download it into \\(looked in {shared}/weights and {shared}/tmp/"):
        pretrained.fetch("orb_mptraj_only_v2")


def test_weights_by_name_load_as_the_file_they_are(mirror, monkeypatch, tmp_path):
    """``read_weights(NAME)``: the served file's arrays, value for value, from a MindSpore copy made once and named
    with the model (orb-v3's 20-neighbour model, which its tensors alone read as the unlimited one); a damaged copy is
    made again from the verified download without the network; the calculator by name predicts what the calculator
    on the PyTorch file does."""
    from ase.build import bulk

    from orb.inference.calculator import ORBCalculator
    from orb.io.checkpoint import architecture, read_weights
    from orb.io.torch_format import read_torch_checkpoint

    source = recipe_file("orb_v3_direct_20_omat", tmp_path)
    serve(mirror, "orb_v3_direct_20_omat", source)
    expected = read_torch_checkpoint(source)
    weights, meta = read_weights("orb_v3_direct_20_omat")
    assert list(weights) == list(expected)
    assert all(np.array_equal(weights[k], expected[k]) for k in expected)
    assert architecture(weights, meta).max_neighbors == 20
    assert architecture(expected, {}).max_neighbors == 120  # what the tensors alone say
    copies = [n for n in os.listdir(tmp_path / "cache" / "weights") if n.startswith("weights-")]
    assert len(copies) == 1
    unreachable(monkeypatch)
    copy = tmp_path / "cache" / "weights" / copies[0]
    damaged = bytearray(copy.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    copy.write_bytes(bytes(damaged))
    again, _ = read_weights("orb-v3-direct-20-omat")
    assert all(np.array_equal(again[k], expected[k]) for k in expected)
    assert copy.read_bytes() != bytes(damaged)

    small = recipe_file("orb_d3_xs_v2", tmp_path)
    monkeypatch.setenv("ORB_WEIGHTS_URL", mirror.url)
    serve(mirror, "orb_d3_xs_v2", small)
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 1, 1))
    atoms.rattle(0.05, seed=1)
    energies = []
    for calc in (ORBCalculator.from_pretrained("orb_d3_xs_v2", device_target="CPU"),
                 ORBCalculator.from_checkpoint(small, device_target="CPU", model_name="orb_d3_xs_v2")):
        atoms.calc = calc
        energies.append((atoms.get_potential_energy(), atoms.get_forces().copy()))
    assert energies[0][0] == energies[1][0]
    np.testing.assert_array_equal(energies[0][1], energies[1][1])
    with pytest.raises(Exception, match="unknown model name 'orb_v4'"):
        ORBCalculator.from_pretrained("orb_v4")


def test_a_config_naming_weights_sets_the_model_or_is_refused():
    from orb.errors import ConfigError
    from orb.training.config import load_config

    cfg = load_config(None, ["--checkpoint_path", "orb_v3_direct_20_omat"])
    assert cfg.model.name == "orb_v3_direct_20_omat" and cfg.model.max_neighbors == 20
    cfg = load_config(None, ["--checkpoint_path", "orb-v2-20241011.ckpt", "--model.name", "orb_v2"])
    assert cfg.model.name == "orb_v2"
    with pytest.raises(ConfigError, match="'checkpoint_path' names the published weights of orb_v2, but 'model.name' "
                       "is orb_v3_direct_20_omat"):
        load_config(None, ["--checkpoint_path", "orb_v2", "--model.name", "orb_v3_direct_20_omat"])


@pytest.mark.alone  # its fine-tuning of orb-d3-xs beside another fine-tuning, late in the run: 5.8-5.9 GB
def test_fine_tune_by_name_then_start_again_offline(mirror, monkeypatch, tmp_path):
    """A run whose config names the weights downloads them once; its resume (a requeued job on a node without
    network) reads the cache."""
    source = recipe_file("orb_d3_xs_v2", tmp_path)
    serve(mirror, "orb_d3_xs_v2", source)
    config = tmp_path / "run.yaml"
    config.write_text(f"train_data_path: {MPTRJ_DB}\nval_data_path: ''\ncheckpoint_path: orb_d3_xs_v2\n"
                      f"output_dir: {tmp_path / 'run'}\ndevice_target: CPU\nbatch_size: 5\nmax_epochs: 1\n"
                      "num_buckets: 1\ndata_workers: 0\nprogress_bar: false\n")
    command = [sys.executable, os.path.join(ROOT, "finetune.py"), "--config", str(config)]
    from orb.files import free_port

    offline = subprocess.run(command, capture_output=True, text=True, timeout=900,  # (it left train.log, checkpoints/)
                             env=dict(os.environ, ORB_WEIGHTS_URL=f"http://127.0.0.1:{free_port()}"))
    assert offline.returncode == 1 and "cannot reach" in offline.stderr, offline.stderr[-2000:]
    assert not (tmp_path / "run").exists()
    first = subprocess.run(command, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "orb_d3_xs_v2: downloading" in first.stdout + first.stderr
    requests = mirror.requests
    unreachable(monkeypatch)
    again = subprocess.run(command + ["--resume", "auto", "--max_epochs", "2", "--accept_config_changes"],
                           capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "downloading" not in again.stdout + again.stderr and mirror.requests == requests


def test_orb_download_fills_the_cache(mirror, monkeypatch, tmp_path):
    """``orb-download NAME`` on a login node: the file and its MindSpore copy, so a job reads both offline."""
    source = recipe_file("orb_d3_xs_v2", tmp_path)
    serve(mirror, "orb_d3_xs_v2", source)
    command = [sys.executable, "-m", "orb.io.download"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run(command + ["orb-d3-xs-v2"], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"orb_d3_xs_v2: {tmp_path / 'cache' / 'weights' / 'orb-d3-xs-v2-20241011.ckpt'}" in result.stdout
    assert len([n for n in os.listdir(tmp_path / "cache" / "weights") if n.startswith("weights-")]) == 1
    listed = subprocess.run(command + ["--list"], capture_output=True, text=True, timeout=300, env=env)
    assert listed.returncode == 0 and "orb_d3_xs_v2                   cached" in listed.stdout
    bad = subprocess.run(command + ["orb_v9"], capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: unknown model name 'orb_v9'")
    assert len(bad.stderr.strip().splitlines()) == 1
    serve(mirror, "orb_d3_sm_v2", source)  # a mirror's wrong file: the xs model served as sm
    wrong = subprocess.run(command + ["orb_d3_sm_v2"], capture_output=True, text=True, timeout=600, env=env)
    said = wrong.stderr.strip().splitlines()[-1]
    assert wrong.returncode == 2 and "orb-d3-sm-v2-20241011.ckpt (served as orb_d3_sm_v2) holds " in said
    assert "5 message-passing layers" in said and "10 message-passing layers" in said  # (xs's 5, sm's 10)
    assert said.endswith(f"it was removed from the cache: check the copy at {mirror.url}/forcefields/"
                         "orb-d3-sm-v2-20241011.ckpt, then fetch it again"), wrong.stderr[-2000:]
    kept = os.listdir(tmp_path / "cache" / "weights")  # (it was kept, verified by its record, and every later use of
    assert not any(n.startswith("orb-d3-sm-v2") for n in kept), kept  # the name failed on it)
