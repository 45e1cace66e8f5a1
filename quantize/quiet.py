"""The libraries' chatter, kept behind --verbose: datasets' "Generating split" bars, lm-eval's bar per task while
it builds requests (57 for MMLU), its truncation line per long item, and transformers' notes on what quantize does
on purpose (a kimi_k2 config read as deepseek_v3, a compressed-tensors quantization_config). Every other warning
still shows; truncations are counted and said once by the caller."""

import logging
import re
import sys
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

# transformers notes on what quantize does on purpose
EXPECTED = re.compile(r"You passed `?quantization_config`?|You are using a model of type \S+ to instantiate a model of type")
TRUNCATED = re.compile(r"exceeds model's maximum length \((\d+)\)|Left truncation applied")
# lm-eval on its own wikitext definition (the perplexity task), which leaves bits_per_byte's defaults implicit
DEFAULTED = re.compile(r"is defined, but (aggregation|higher_is_better) is not")


@dataclass
class Counts:
    truncated: int = 0
    max_length: int | None = None


class _Drop(logging.Filter):
    def __init__(self, pattern: re.Pattern, counts: Counts | None = None):
        super().__init__()
        self.pattern, self.counts = pattern, counts

    def filter(self, record: logging.LogRecord) -> bool:
        m = self.pattern.search(record.getMessage())
        if m and self.counts is not None:
            self.counts.truncated += 1
            self.counts.max_length = int(m[1]) if m.lastindex else self.counts.max_length
        return m is None


@contextmanager
def libraries(verbose: bool = False):
    """Within the block, the chatter above is off (unless `verbose`); yields the Counts of what was dropped."""
    counts = Counts()
    if verbose:
        yield counts
        return
    undo, stack = [], ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", message=EXPECTED.pattern)  # transformers also says it with warnings.warn
    undo.append(stack.close)
    tf = _transformers_logging()
    if tf is not None:
        was = tf.is_progress_bar_enabled()
        tf.disable_progress_bar()
        undo.append(lambda: tf.enable_progress_bar() if was else None)
        drop = _Drop(EXPECTED)
        for h in tf._get_library_root_logger().handlers:
            h.addFilter(drop)
            undo.append(lambda h=h: h.removeFilter(drop))
    # only what the caller has loaded: a calibrated convert must not pay for importing lm-eval and datasets
    datasets, task = sys.modules.get("datasets"), sys.modules.get("lm_eval.api.task")
    if datasets is not None:
        was_ds = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        undo.append(lambda: datasets.enable_progress_bars() if was_ds else None)
    if task is not None:
        bar = task.tqdm
        task.tqdm = lambda *a, **k: bar(*a, **{**k, "disable": True})
        undo.append(lambda: setattr(task, "tqdm", bar))
    filters = [(n, DEFAULTED, None) for n in ("lm_eval.api.task", "lm_eval.tasks")]
    filters += [(n, TRUNCATED, counts) for n in ("lm_eval.models.huggingface", "lm_eval.models.vllm_causallms",
                                                 "lm_eval.api.model")]
    for name, pattern, counted in filters:
        logger, drop = logging.getLogger(name), _Drop(pattern, counted)
        logger.addFilter(drop)
        undo.append(lambda logger=logger, drop=drop: logger.removeFilter(drop))
    try:
        yield counts
    finally:
        for u in reversed(undo):
            u()


def _transformers_logging():
    try:
        from quantize import hf

        return hf.transformers().utils.logging
    except ImportError:
        return None
