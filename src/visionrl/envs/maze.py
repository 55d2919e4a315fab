"""The `maze` environment: a grid game with a picture of the board at every turn.

The board is an n x n grid: walls (dark), the goal (green), the player (red). Each turn the model answers with a
move (`up`, `down`, `left` or `right`, the first of these words in its text); the environment shows the board
after the move. Reaching the goal gives reward 1 and ends the episode; a move into a wall or off the board leaves
the player where it was. The board comes from the record's `maze` field (rows of `#` wall, `.` floor, `S` start,
`G` goal) or, without one, is drawn from the record's `seed` (a random board with a free path)."""

from __future__ import annotations

import random
from typing import Any

from PIL import Image, ImageDraw

from visionrl.envs.base import Env, Observation, StepResult

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
PROMPT = "Move the red square to the green square. Answer with one move: up, down, left or right."
CELL = 32  # pixels per grid cell in the picture


def random_board(size: int, seed: int) -> list[str]:
    """A size x size board with a start, a goal and walls that leave a path between them."""
    rng = random.Random(seed)
    while True:
        cells = [["#" if rng.random() < 0.25 else "." for _ in range(size)] for _ in range(size)]
        free = [(r, c) for r in range(size) for c in range(size)]
        start, goal = rng.sample(free, 2)
        cells[start[0]][start[1]], cells[goal[0]][goal[1]] = "S", "G"
        board = ["".join(row) for row in cells]
        if _reachable(board, start, goal):
            return board


def _reachable(board: list[str], start: tuple[int, int], goal: tuple[int, int]) -> bool:
    seen, todo = {start}, [start]
    while todo:
        r, c = todo.pop()
        if (r, c) == goal:
            return True
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if (
                0 <= nr < len(board)
                and 0 <= nc < len(board)
                and board[nr][nc] != "#"
                and (nr, nc) not in seen
            ):
                seen.add((nr, nc))
                todo.append((nr, nc))
    return False


def draw_board(board: list[str], player: tuple[int, int]) -> Image.Image:
    n = len(board)
    picture = Image.new("RGB", (n * CELL, n * CELL), (235, 235, 235))
    draw = ImageDraw.Draw(picture)
    for r, row in enumerate(board):
        for c, cell in enumerate(row):
            box = (c * CELL, r * CELL, (c + 1) * CELL - 1, (r + 1) * CELL - 1)
            if cell == "#":
                draw.rectangle(box, fill=(40, 40, 40))
            elif cell == "G":
                draw.rectangle(box, fill=(30, 170, 60))
    r, c = player
    draw.rectangle((c * CELL + 4, r * CELL + 4, (c + 1) * CELL - 5, (r + 1) * CELL - 5), fill=(210, 30, 30))
    return picture


class MazeEnv(Env):
    def __init__(self, size: int = 5) -> None:
        self.size = size
        self.board: list[str] = []
        self.player = (0, 0)

    def reset(self, record: dict[str, Any]) -> Observation:
        board = record.get("maze")
        self.board = list(board) if board else random_board(self.size, int(record.get("seed", 0)))
        self.player = self._find("S")
        return Observation(
            text=str(record.get("prompt") or PROMPT), images=[draw_board(self.board, self.player)]
        )

    def _find(self, mark: str) -> tuple[int, int]:
        for r, row in enumerate(self.board):
            if mark in row:
                return r, row.index(mark)
        raise ValueError(f"the maze has no {mark!r}")

    def step(self, action: str) -> StepResult:
        words = [w.strip(".,!?") for w in action.lower().split()]
        move = next((w for w in words if w in MOVES), None)
        if move is None:
            text = "Answer with one move: up, down, left or right."
            return StepResult(Observation(text, [draw_board(self.board, self.player)]), info={"invalid": 1})
        dr, dc = MOVES[move]
        r, c = self.player[0] + dr, self.player[1] + dc
        if 0 <= r < len(self.board) and 0 <= c < len(self.board) and self.board[r][c] != "#":
            self.player = (r, c)
        if self.board[self.player[0]][self.player[1]] == "G":
            return StepResult(None, reward=1.0, done=True, info={"solved": 1})
        return StepResult(Observation("", [draw_board(self.board, self.player)]))
