"""Capture: from the user's model to a graph fxmem can run (``torch.fx`` symbolic tracing), and
where each piece of it came from in the user's source.

>>> gm = trace(torch.nn.Linear(4, 2))                        # doctest: +SKIP
>>> forward_arguments(gm)                                      # doctest: +SKIP
(['input'], 1)
"""
from .source import SourceLine, is_user_file, model_files, module_path, source_line, statement_of, statement_text
from .trace import forward_arguments, helper_modules, trace

__all__ = ["trace", "forward_arguments", "helper_modules", "SourceLine", "source_line", "module_path",
           "is_user_file", "model_files", "statement_of", "statement_text"]
