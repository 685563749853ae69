#!/usr/bin/env python3
"""Checks of the PyTorch twin's pieces against the values the Rust code's own tests state
(crates/train/src/schedule.rs, crates/train/src/data.rs), and of its safetensors files.

Usage: target/peers-venv/bin/python scripts/peers/test_train_gpt_torch.py
(needs torch; the safetensors check also needs the safetensors package and numpy, and is
skipped without them).
"""

import math
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gpt_torch as t  # noqa: E402


class Data(unittest.TestCase):
    def test_splitmix64(self):
        # Vigna's splitmix64 from state 0: the first outputs.
        self.assertEqual(t.splitmix64(0), 0xE220A8397B1DCDAF)
        self.assertEqual(t.splitmix64(0x9E3779B97F4A7C15), 0x6E789E6AA1B965F4)

    def test_split_rounds_half_away_from_zero(self):
        # n * fraction = 2.5: Rust's f64::round gives 3 (Python's round() would give 2).
        train, held = t.split(bytes(range(25)), 0.1, 1)
        self.assertEqual((len(train), len(held)), (22, 3))
        self.assertEqual(train + held, bytes(range(25)))

    def test_batch_windows(self):
        tokens = bytes(i % 251 for i in range(10_000))
        x, y = t.batch_ids(tokens, 3, 4, 16, 0)
        self.assertEqual((len(x), len(y)), (64, 64))
        for b in range(4):
            self.assertEqual(x[16 * b + 1 : 16 * b + 16], y[16 * b : 16 * b + 15])
        self.assertEqual((x, y), t.batch_ids(tokens, 3, 4, 16, 0))
        self.assertNotEqual(x, t.batch_ids(tokens, 4, 4, 16, 0)[0])


class Schedule(unittest.TestCase):
    def test_as_schedule_rs(self):
        self.assertEqual(t.lr_at(0, 1e-3, 10, "cosine", 100, 1e-4), 1e-4)
        self.assertEqual(t.lr_at(9, 1e-3, 10, "cosine", 100, 1e-4), 1e-3)
        lrs = [t.lr_at(i, 1.0, 4, "cosine", 12, 0.1) for i in range(12)]
        self.assertEqual(lrs[:5], [0.25, 0.5, 0.75, 1.0, 1.0])
        self.assertAlmostEqual(lrs[11], 0.1, delta=1e-15)
        self.assertAlmostEqual(lrs[7], 0.1 + 0.5 * (1 + math.cos(math.pi * 3 / 7)) * 0.9, delta=1e-15)
        self.assertEqual([t.lr_at(i, 2.0, 0, "linear", 5, 0.0) for i in range(5)], [2.0, 1.5, 1.0, 0.5, 0.0])
        self.assertEqual(t.lr_at(0, 3e-4, 2, "none", 10, 0.0), 1.5e-4)
        self.assertEqual(t.lr_at(0, 1.0, 0, "cosine", 1, 0.0), 1.0)

    def test_decay_policy(self):
        m = "matrices"
        self.assertTrue(t.decays(m, "blocks.0.attn.qkv.weight", [96, 32]))
        self.assertFalse(t.decays(m, "blocks.0.attn.qkv.bias", [96]))
        self.assertFalse(t.decays(m, "tok_emb.weight", [256, 32]))
        self.assertFalse(t.decays(m, "pos_emb.weight", [64, 32]))
        self.assertTrue(t.decays(m, "lm_head.weight", [256, 32]))
        self.assertTrue(t.decays("matrices+embeddings", "tok_emb.weight", [256, 32]))
        self.assertTrue(t.decays("all", "ln_f.bias", [32]))


class Model(unittest.TestCase):
    def test_attention_forms_agree_and_init_round_trips(self):
        import torch

        cfg = dict(t.PRESETS["tiny"], vocab=256, layers=2, seq_len=32)
        p = t.init_params(cfg, 0)
        self.assertEqual(sorted(p), sorted(n for n, _, _ in t.param_shapes(cfg)))
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 256, (2, 32), generator=g)
        tg = torch.randint(0, 256, (2, 32), generator=g)
        a = t.forward_loss(p, cfg, ids, tg, "manual").item()
        b = t.forward_loss(p, cfg, ids, tg, "sdpa").item()
        self.assertLess(abs(a - b) / b, 1e-6)
        self.assertLess(abs(a - math.log(256)) / math.log(256), 0.05)  # near uniform at init
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "init.safetensors")
            t.save_safetensors(path, p)
            q = t.load_safetensors(path)
            self.assertTrue(all(torch.equal(p[n], q[n]) for n in p))
            try:
                from safetensors.numpy import load_file
            except ImportError:
                return
            ref = load_file(path)
            self.assertTrue(all(torch.equal(p[n], torch.from_numpy(ref[n])) for n in p))

    def test_timing_summary_leaves_the_warmup_out(self):
        import json

        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "run")
            argv = ["--preset", "tiny", "--layers", "1", "--width", "32", "--heads", "2", "--seq-len", "16",
                    "--vocab", "64", "--batch", "2", "--steps", "4", "--timing-warmup", "1",
                    "--attention", "sdpa", "--precision", "bf16", "--out", out, "--quiet"]
            self.assertEqual(t.main(argv), 0)
            with open(out + ".json") as f:
                s = json.load(f)
            self.assertEqual(len(s["step_ms_all"]), 4)
            self.assertEqual(s["step_ms"], t.step_stats(s["step_ms_all"][1:]))
            self.assertEqual(s["step_ms"]["n"], 3)
            self.assertAlmostEqual(s["tokens_per_s"], 2 * 16 / (s["step_ms"]["median"] / 1e3))
            self.assertIsNone(s["gpu_step_ms"])
            self.assertEqual((s["precision"], s["attention"]), ("bf16", "sdpa"))
            self.assertTrue(all(math.isfinite(x) for x in s["losses"]))
            with self.assertRaises(SystemExit) as e:
                t.main(argv + ["--timing-warmup", "4"])  # the last --timing-warmup counts
            self.assertIn("--timing-warmup 4", str(e.exception.code))

    def test_f32_str_reads_back(self):
        import struct

        for v in (5.6665564, 3.0, 1e-7, 0.1, 123456.789):
            f = struct.unpack("<f", struct.pack("<f", v))[0]
            self.assertEqual(struct.unpack("<f", struct.pack("<f", float(t.f32_str(f))))[0], f)


if __name__ == "__main__":
    unittest.main()
