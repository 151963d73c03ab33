"""Two LiveCodeBench records in the Hub layout (lighteval/code_generation_lite: public cases as JSON, private ones
base64 → zlib → pickle → JSON, metadata with func_name for LeetCode problems) and completions with the verdict
LiveCodeBench's grader gives each (checked against lighteval 0.13's codegen_metrics.run_test once, outside CI)."""

from __future__ import annotations

import base64
import json
import pickle
import zlib


def encode(cases: list[dict]) -> str:
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


STDIN = {
    "question_content": "Read two integers a and b on one line and print a + b.",
    "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
    "private_test_cases": encode([{"input": "10 -4\n", "output": "6\n", "testtype": "stdin"}]),
    "metadata": "{}",
    "starter_code": "",
}
CALL = {
    "question_content": "Return the indices of the two numbers that add up to target.",
    "public_test_cases": json.dumps([{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"}]),
    "private_test_cases": encode([{"input": "[3, 2, 4]\n6", "output": "[1, 2]", "testtype": "functional"}]),
    "metadata": json.dumps({"func_name": "twoSum"}),
    "starter_code": "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        ",
}
RECORDS = [STDIN, CALL]

FENCE = "```"
COMPLETIONS = [
    [
        f"Here:\n{FENCE}python\na, b = map(int, input().split())\nprint(a + b)\n{FENCE}\n",  # right
        f"{FENCE}python\nimport sys\nprint(sum(map(int, sys.stdin.read().split())) + 1)\n{FENCE}",  # wrong
        f"{FENCE}python\nif __name__ == '__main__':\n    a, b = map(int, input().split())\n    print(a + b)\n{FENCE}",
        "print(3)",  # no fences: no code
    ],
    [
        f"{FENCE}python\nclass Solution:\n    def twoSum(self, nums, target):\n        seen = {{}}\n"
        f"        for i, x in enumerate(nums):\n            if target - x in seen:\n"
        f"                return (seen[target - x], i)\n            seen[x] = i\n{FENCE}",  # right (a tuple)
        f"{FENCE}python\nclass Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n{FENCE}",
        f"{FENCE}python\nclass Solution:\n    def twoSum(self, nums, target):\n        raise ValueError\n{FENCE}",
        f"{FENCE}python\nclass Solution:\n    def twoSum(self, nums, target):\n        import os\n"
        f"        return os.listdir('/root')\n{FENCE}",  # reads outside: fails in the sandbox
    ],
]
PASSED = [[True, False, True, False], [True, False, False, False]]
