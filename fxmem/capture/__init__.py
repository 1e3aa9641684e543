"""Capture: from the user's model to a graph fxmem can run (``torch.fx`` symbolic tracing), and
where each piece of it came from in the user's source.

>>> gm = trace(torch.nn.Linear(4, 2))                        # doctest: +SKIP

>>> forward_parameters(gm).names                               # doctest: +SKIP
('input',)
"""
from .choice import Capture, fallback
from .source import (Parameters, SourceLine, forward_parameters, is_user_file, model_files, module_path, raised_at, running_line,
                     short_path, source_line, statement_of, statement_text)
from .trace import check_leaf_modules, helper_modules, private_copy, trace

__all__ = ["trace", "Capture", "fallback", "forward_parameters", "Parameters", "private_copy", "check_leaf_modules",
           "helper_modules", "SourceLine", "source_line", "module_path",
           "is_user_file", "model_files", "raised_at", "running_line", "short_path", "statement_of", "statement_text"]
