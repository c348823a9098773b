"""Models by Hugging Face Hub id, from a Hub cache laid out as huggingface_hub writes it.

The machine has no network, so the cache is built by hand: huggingface_hub (2.4) has no public
call that imports a folder into its cache (`upload_folder` needs a Hub; `snapshot_download`
with `local_dir` copies the other way). `add_to_hub_cache` writes what a download writes:
blobs/, snapshots/<commit>/ of relative symlinks, refs/<name> holding the commit, and
huggingface_hub's own `scan_cache_dir` and `snapshot_download` must read it back.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants, scan_cache_dir, snapshot_download
from huggingface_hub.file_download import repo_folder_name
from transformers import AutoModelForCausalLM

from tests.test_server import Server
from tests.test_startup_errors import assert_clear_error, serve
from tests.tiny_models import tiny_checkpoint_dir
from treadle import LLM, SamplingParams
from treadle.models.loader import default_model_path, is_gguf, resolve_model

REPO = "tiny-org/tiny-llama"
COMMIT_MAIN, COMMIT_V2 = "a" * 40, "b" * 40
ENGINE_ARGS = {"max_model_len": 128, "block_size": 16, "num_kv_blocks": 20}
PROMPT_IDS = [1, 520, 3027, 314, 2380, 282, 4301, 314]
MAX_TOKENS = 8


def add_to_hub_cache(cache: Path, repo_id: str, folder: str | Path, commit: str, ref: str) -> Path:
    """Put `folder`'s files into the Hub cache `cache` as snapshot `commit` of `repo_id`, with
    `ref` (a branch or tag) naming it; returns the snapshot folder."""
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = storage / "snapshots" / commit
    for file in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            os.symlink(os.path.realpath(file), blob) if file.suffix == ".gguf" else \
                blob.write_bytes(file.read_bytes())
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> dict[str, Path]:
    """A Hub cache holding REPO at main (the tiny Llama) and at tag v2 (other random weights)."""
    cache = tmp_path_factory.mktemp("hub-cache")
    return {"cache": cache,
            "main": add_to_hub_cache(cache, REPO, tiny_checkpoint_dir("llama", tmp_path_factory),
                                     COMMIT_MAIN, "main"),
            "v2": add_to_hub_cache(cache, REPO, tiny_checkpoint_dir("llama", tmp_path_factory,
                                                                    seed=1), COMMIT_V2, "v2")}


@pytest.fixture
def offline(hub_cache, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 with HF_HUB_CACHE at the test cache, for this process (huggingface_hub
    reads both once, at import)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache["cache"]))
    return hub_cache["cache"]


def transformers_greedy(folder: Path) -> list[int]:
    """Argmax decoding by transformers' own from_pretrained load of `folder`, no EOS stop."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = list(PROMPT_IDS)
    with torch.inference_mode():
        for _ in range(MAX_TOKENS):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT_IDS):]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_the_cache_is_one_huggingface_hub_reads(hub_cache):
    info = scan_cache_dir(hub_cache["cache"])
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {COMMIT_MAIN: {"main"},
                                                                     COMMIT_V2: {"v2"}}
    for ref, commit in (("main", COMMIT_MAIN), ("v2", COMMIT_V2)):
        assert snapshot_download(REPO, revision=ref, cache_dir=hub_cache["cache"],
                                 local_files_only=True) == str(hub_cache[ref])


def test_resolve_ids_revisions_and_download_dir(hub_cache, offline, tmp_path, monkeypatch):
    assert resolve_model(REPO) == str(hub_cache["main"])
    assert resolve_model(REPO, revision="v2") == str(hub_cache["v2"])
    assert resolve_model(REPO, revision=COMMIT_V2) == str(hub_cache["v2"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    assert resolve_model(REPO, download_dir=str(hub_cache["cache"])) == str(hub_cache["main"])
    with pytest.raises(ValueError, match=r"'tiny-org/tiny-llama' at revision 'v3' is not in the "
                                         r"Hugging Face cache .*hf download tiny-org/tiny-llama.*"
                                         r"unset HF_HUB_OFFLINE"):
        resolve_model(REPO, revision="v3", download_dir=str(hub_cache["cache"]))


def test_a_local_path_wins_over_a_hub_id(hub_cache, offline, tmp_path, monkeypatch):
    local = tmp_path / REPO
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO) == REPO   # the folder here, not the cached snapshot


def test_a_gguf_is_named_by_its_file(offline, tmp_path, monkeypatch):
    gguf = default_model_path()
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "smollm2.gguf").symlink_to(gguf)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    add_to_hub_cache(tmp_path / "cache", "tiny-org/smol-gguf", folder, "c" * 40, "main")
    path = resolve_model("tiny-org/smol-gguf/smollm2.gguf")
    assert is_gguf(path) and os.path.realpath(path) == os.path.realpath(gguf)
    with pytest.raises(ValueError, match=r"no config\.json; .* tiny-org/smol-gguf/FILE\.gguf"):
        resolve_model("tiny-org/smol-gguf")


def test_the_network_failing_falls_back_to_the_cache(hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")   # discard: refused
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache["cache"]))
    assert resolve_model(REPO, revision="v2") == str(hub_cache["v2"])
    with pytest.raises(ValueError, match=r"'tiny-org/absent' is not in the Hugging Face cache .*"
                                         r"once the Hub can be reached"):
        resolve_model("tiny-org/absent")


def test_llm_by_id_offline_with_revisions_and_load_weights(hub_cache, offline):
    main, v2 = transformers_greedy(hub_cache["main"]), transformers_greedy(hub_cache["v2"])
    assert main != v2   # the two snapshots are told apart by their output
    prompt = {"prompt_token_ids": PROMPT_IDS}
    with LLM(REPO, revision="v2", **ENGINE_ARGS) as llm:
        assert llm.engine.config.model.model == str(hub_cache["v2"])
        assert list(llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == v2
        llm.load_weights(REPO)   # an RL reload by id: main, from the cache
        assert list(llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == main


def test_serve_by_id_offline(hub_cache, tmp_path):
    srv = Server(REPO, tmp_path, env={"HF_HUB_OFFLINE": "1",
                                      "HF_HUB_CACHE": str(hub_cache["cache"])})
    try:
        reply = srv.client().completions.create(
            model="tiny-llama", prompt=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
    finally:
        assert srv.stop() == 0, srv.log()
    assert "model files in" in srv.log() and str(hub_cache["main"]) in srv.log()
    assert reply.choices[0].token_ids == transformers_greedy(hub_cache["main"])


def test_serve_offline_without_the_model_says_how_to_get_it(tmp_path):
    out, _ = serve("tiny-org/not-cached", "--port", "0",
                   env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    assert_clear_error(out, "'tiny-org/not-cached'", "not in the Hugging Face cache",
                       "hf download tiny-org/not-cached", "unset HF_HUB_OFFLINE")


def test_huggingface_hub_is_a_declared_dependency():
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert '"huggingface_hub>=' in pyproject and huggingface_hub.__version__


def test_a_mistral_layout_reads_only_the_shards_its_index_names(tmp_path):
    """Mistral's repos (Mistral-7B-Instruct-v0.3, Nemo, Small) hold HF shards with an index and
    the same weights again in `consolidated.safetensors` under Mistral's own names: transformers
    and vLLM read the shards the index names; treadle read every file and refused the model."""
    from safetensors.torch import save_file

    from tests.tiny_models import make_tiny_checkpoint

    path = tmp_path / "mistral"
    make_tiny_checkpoint("mistral", path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    (path / "model.safetensors").unlink()
    model.save_pretrained(path, max_shard_size="100KB")   # sharded, with an index
    assert (path / "model.safetensors.index.json").exists()
    weights = model.state_dict()
    native = {"tok_embeddings.weight": weights["model.embed_tokens.weight"].clone(),
              "layers.0.attention.wq.weight": weights["model.layers.0.self_attn.q_proj.weight"].clone()}
    save_file(native, str(path / "consolidated.safetensors"))
    prompt = [1, 520, 3027, 314, 2380, 282, 4301, 314]
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(4):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    with LLM(str(path), max_model_len=64, block_size=16, num_kv_blocks=8) as llm:
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == ids[len(prompt):]


def test_load_weights_by_id_looks_in_the_engines_download_dir(tmp_path, tmp_path_factory,
                                                              monkeypatch):
    """An engine started from a Hub id with `download_dir` reloads by id from that cache: it
    looked in the default cache (offline, a 'not in the cache' error; online, a second
    download of the whole model)."""
    cache = tmp_path / "models"
    add_to_hub_cache(cache, REPO, tiny_checkpoint_dir("llama", tmp_path_factory), COMMIT_MAIN, "main")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "default-cache-empty"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(REPO, download_dir=str(cache), max_model_len=64, block_size=16, num_kv_blocks=8) as llm:
        before = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)
        llm.load_weights(REPO, weight_version="again")
        after = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)
    assert before[0].outputs[0].token_ids == after[0].outputs[0].token_ids
    assert after[0].weight_version == "again"
