"""jupyter_kernel_test's conformance suite against the installed ``monarch`` kernelspec."""
from __future__ import annotations

import os
import unittest

import jupyter_kernel_test
from kernel_harness import ensure_kernelspec


class MonarchKernelConformance(jupyter_kernel_test.KernelTests):
    kernel_name = "monarch"
    language_name = "python"
    file_extension = ".py"
    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('err', file=sys.stderr)"
    completion_samples = [{"text": "zi", "matches": {"zip"}}]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]
    code_page_something = "zip?"
    code_generate_error = "raise ValueError('boom')"
    code_execute_result = [{"code": "1+2+3", "result": "6"}, {"code": "[n*n for n in range(1, 4)]",
                                                               "result": "[1, 4, 9]"}]
    code_display_data = [{"code": "from IPython.display import HTML, display; display(HTML('<b>x</b>'))",
                          "mime": "text/html"}]
    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"

    @classmethod
    def setUpClass(cls):
        ensure_kernelspec()
        cls._old_prewarm = os.environ.get("MONARCH_KERNEL_PREWARM")
        os.environ["MONARCH_KERNEL_PREWARM"] = "0"   # these tests never connect a mesh
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        if cls._old_prewarm is None:
            os.environ.pop("MONARCH_KERNEL_PREWARM", None)
        else:
            os.environ["MONARCH_KERNEL_PREWARM"] = cls._old_prewarm

    def test_kernel_info_names_the_monarch_implementation(self):
        self.flush_channels()
        reply = self.kc.kernel_info(reply=True, timeout=10)
        assert reply["content"]["implementation"] == "monarch_kernel"
        assert reply["content"]["language_info"]["name"] == "python"

    def test_magics_are_loaded(self):
        self.flush_channels()
        reply, output_msgs = self.execute_helper(code="%mesh")
        assert reply["content"]["status"] == "ok"
        assert "connect" in "".join(m["content"].get("text", "") for m in output_msgs)


if __name__ == "__main__":
    unittest.main()
