"""A checkpoint's big files are hashed as they are written (one pass over their bytes), and the
manifest still holds every file's size and hash for `verify` to check."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo.models.tiny import char_tokenizer, tiny_model
from grpo.run import checkpoint


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(0)
    return {
        "a.weight": torch.randn(3, 4, generator=generator),
        "b": torch.randn(5, generator=generator).to(torch.bfloat16),
        "c": torch.arange(7, device="cpu"),
        "empty": torch.zeros(0, 3, device="cpu"),
        "scalar": torch.tensor(3.0, device="cpu"),
        "mask": torch.ones(2, 2, dtype=torch.bool, device="cpu"),
        "half": torch.ones(3, dtype=torch.float16, device="cpu"),
    }


def test_write_safetensors_writes_the_bytes_safetensors_writes(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    with checkpoint.HashedFile(tmp_path / "ours.safetensors") as f:
        checkpoint.write_safetensors(tensors, f, {"format": "pt"})
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()
    assert (f.size, f.hexdigest()) == (
        len(ours),
        checkpoint._DIGESTS[checkpoint.DIGEST](ours).hexdigest(),
    )
    loaded = load_file(tmp_path / "ours.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_a_hashed_file_hashes_small_and_large_writes_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_BESIDE", 64)  # the second thread for all but the small ones
    chunks = [b"x" * 10, bytes(range(256)) * 3, memoryview(b"tail" * 40), b""]
    with checkpoint.HashedFile(tmp_path / "f") as f:
        for chunk in chunks:
            f.write(chunk)
    data = (tmp_path / "f").read_bytes()
    assert data == b"".join(bytes(c) for c in chunks)
    assert (f.size, f.hexdigest()) == (
        len(data),
        checkpoint._DIGESTS[checkpoint.DIGEST](data).hexdigest(),
    )


def test_a_checkpoint_hashes_its_weights_and_state_as_written_and_verify_still_checks_them(
    tmp_path, monkeypatch
):
    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4, dtype=torch.long, device="cpu")).logits.sum().backward()
    optimizer.step()
    state = {"train": {"step": 3, "optimizer": optimizer.state_dict()}}
    read_back = []
    real_digest = checkpoint._file_digest
    monkeypatch.setattr(
        checkpoint,
        "_file_digest",
        lambda path, *a: read_back.append(path.name) or real_digest(path, *a),
    )
    crc32 = torch.serialization.get_crc32_options()
    path = checkpoint.save_checkpoint(tmp_path / "checkpoint-3", model, tokenizer, state, step=3)
    assert torch.serialization.get_crc32_options() == crc32  # as it was
    # the big files were never read back to be hashed; the small ones were
    assert "model.safetensors" not in read_back and checkpoint.STATE not in read_back
    assert "config.json" in read_back
    files = json.loads((path / checkpoint.MANIFEST).read_text())["files"]
    assert {"model.safetensors", checkpoint.STATE, "config.json"} <= set(files)
    for name, meta in files.items():
        data = (path / name).read_bytes()
        assert meta == {
            "size": len(data),
            checkpoint.DIGEST: checkpoint._DIGESTS[checkpoint.DIGEST](data).hexdigest(),
        }
    assert checkpoint.problem(path) == ""  # the state loads (weights_only), the weights are finite
    saved = checkpoint.read_state(path / checkpoint.STATE)
    assert torch.equal(
        saved["train"]["optimizer"]["state"][0]["exp_avg"],
        optimizer.state_dict()["state"][0]["exp_avg"],
    )
    type(model).from_pretrained(path)  # still a model directory

    for name in ("model.safetensors", checkpoint.STATE):
        data = bytearray((path / name).read_bytes())
        data[len(data) // 2] ^= 1
        (path / name).write_bytes(data)
        assert (
            checkpoint.verify(path)
            == f"{name} does not match its {checkpoint.DIGEST} in the manifest"
        )
        data[len(data) // 2] ^= 1
        (path / name).write_bytes(data)
    assert checkpoint.verify(path) == ""


def test_weights_of_a_kind_it_does_not_write_go_through_safetensors_and_are_hashed_after(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(checkpoint, "_writes_safetensors", lambda tensors: False)
    read_back = []
    real_digest = checkpoint._file_digest
    monkeypatch.setattr(
        checkpoint,
        "_file_digest",
        lambda path, *a: read_back.append(path.name) or real_digest(path, *a),
    )
    path = checkpoint.save_checkpoint(
        tmp_path / "checkpoint-1",
        tiny_model(char_tokenizer()),
        char_tokenizer(),
        {"train": {"step": 1}},
        step=1,
    )
    assert "model.safetensors" in read_back
    assert checkpoint.verify(path) == ""


def test_a_write_that_fails_midway_leaves_no_checkpoint(tmp_path, monkeypatch):
    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.HashedFile, "write", full)
    with pytest.raises(checkpoint.SaveFailed, match="No space left on device"):
        checkpoint.save_checkpoint(
            tmp_path / "checkpoint-1",
            tiny_model(char_tokenizer()),
            char_tokenizer(),
            {"train": {"step": 1}},
        )
    assert list(tmp_path.iterdir()) == []


def test_final_is_the_last_steps_checkpoint_linked_not_written_again(
    tokenizer, tmp_path, make_trainer, monkeypatch
):
    """With save_steps dividing max_steps, final/ holds checkpoint-N's own files (hard links: no
    byte written twice), verifies, and stays whole when checkpoint-N is pruned away."""
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=2",
            "training.save_steps=2",
            "training.per_device_train_batch_size=16",
        ],
    )
    written, save = [], checkpoint.save_checkpoint
    # the tiny model's weights and state are kilobytes: what counts as big scaled down with them
    monkeypatch.setattr(checkpoint, "_LINKED", 16 << 10)
    monkeypatch.setattr(
        checkpoint,
        "save_checkpoint",
        lambda directory, *a, **k: written.append(directory.name) or save(directory, *a, **k),
    )
    trainer.train()
    run = tmp_path / "run"
    final, last = run / checkpoint.FINAL, run / "checkpoint-2"
    assert written == ["checkpoint-2"]  # final/ was not written
    assert checkpoint.verify(final) == "" and checkpoint.manifest_step(final) == 2
    files = json.loads((last / checkpoint.MANIFEST).read_text())["files"]
    big = [name for name, meta in files.items() if meta["size"] >= 16 << 10]
    assert {checkpoint.STATE, "model.safetensors"} <= set(big) and "config.json" not in big
    for name in files:  # the big files shared, the small ones (configs) copies of their own
        same = (final / name).stat().st_ino == (last / name).stat().st_ino
        assert same == (name in big), name
    checkpoint.remove_checkpoints([last])
    assert checkpoint.verify(final) == ""


def test_final_is_written_when_the_last_step_has_no_checkpoint(tokenizer, tmp_path, make_trainer):
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        [
            "training.max_steps=2",
            "training.save_steps=0",
            "training.per_device_train_batch_size=16",
        ],
    )
    trainer.train()
    final = tmp_path / "run" / checkpoint.FINAL
    assert checkpoint.verify(final) == "" and checkpoint.manifest_step(final) == 2
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_a_checkpoint_whose_manifest_records_sha256_still_verifies(tmp_path):
    """Checkpoints written before the manifest's hash was XXH3-128 record sha256: still checked."""
    import hashlib

    model, tok = tiny_model(char_tokenizer(), hidden_size=16, num_layers=1), char_tokenizer()
    path = checkpoint.save_checkpoint(tmp_path / "c", model, tok, {"step": 1}, step=1)
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    for name, meta in manifest["files"].items():
        manifest["files"][name] = {
            "size": meta["size"],
            "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest(),
        }
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    assert checkpoint.verify(path) == ""
    damaged = path / checkpoint.STATE
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    assert (
        checkpoint.verify(path) == f"{checkpoint.STATE} does not match its sha256 in the manifest"
    )
