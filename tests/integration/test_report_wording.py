"""The words of a real run's report: the peak is named as the phase table names phases and as the module
table names modules, and a run without backward shows no backward columns."""

from __future__ import annotations

import torch
from torch import nn

import memprof


def test_the_peak_of_a_second_micro_batch_is_named_with_its_occurrence_and_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            for _ in range(2):  # two micro-batches per step
                model(torch.randn(256, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
    report = prof.report()
    # The highest phase peak of the run, found without the trace's own pointers: the second backward of
    # step 1, when the first micro-batch's gradients and the momentum buffers are held.
    highest = max(report.trace.phases, key=lambda p: p.peak.total)
    assert (highest.step, highest.phase.value, highest.occurrence) == (1, "backward", 1)
    assert highest.peak.total == report.peak.total
    lines = str(report).splitlines()
    assert lines[2] == "Peak 1.0 MiB (step 1, backward #1, in 1 (ReLU))"
    assert "in 1 (ReLU)" in report._repr_html_() and "backward #1" in report._repr_html_()


def test_an_inference_run_ranks_its_modules_by_their_forward_peak():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with memprof.profile(model) as prof:
        with torch.no_grad():
            model(torch.randn(8, 16))
    lines = str(prof.report()).splitlines()
    # Linear(16, 32): (16 x 32 + 32) x 4 B = 2,176 B of parameters, its output 8 x 32 x 4 B = 1,024 B; the
    # ReLU's output as large; Linear(32, 4): (32 x 4 + 4) x 4 B = 528 B, its output 8 x 4 x 4 B = 128 B.
    at = lines.index("Top modules by peak forward (no backward ran: nothing was saved for one)")
    assert lines[at + 1:at + 5] == [
        "  module                        type                     params      peak fwd",
        "  0                             Linear                  2.1 KiB       1.0 KiB",
        "  1                             ReLU                        0 B       1.0 KiB",
        "  2                             Linear                    528 B         128 B",
    ]
    assert not any("saved act" in line or "peak bwd" in line for line in lines)
