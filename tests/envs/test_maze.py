"""The `maze` environment: a board with a path, moves that respect walls, the goal rewarded, the picture shown."""

from __future__ import annotations

from visionrl.envs.maze import CELL, MazeEnv, _reachable, random_board

BOARD = ["S.#", ".##", "..G"]  # down, down, right, right


def test_random_boards_have_a_path_and_are_reproducible() -> None:
    for seed in range(20):
        board = random_board(5, seed)
        start = next((r, row.index("S")) for r, row in enumerate(board) if "S" in row)
        goal = next((r, row.index("G")) for r, row in enumerate(board) if "G" in row)
        assert _reachable(board, start, goal)
        assert random_board(5, seed) == board


def test_moves_walls_and_the_goal() -> None:
    env = MazeEnv()
    obs = env.reset({"maze": BOARD})
    assert obs.images[0].size == (3 * CELL, 3 * CELL)
    assert obs.images[0].getpixel((CELL // 2, CELL // 2)) == (210, 30, 30)  # the player at the start
    assert env.step("Right!").observation is not None and env.player == (0, 1)
    blocked = env.step("right")  # into the wall: the player stays
    assert blocked.observation is not None and env.player == (0, 1) and blocked.reward == 0.0
    assert env.step("up").observation is not None and env.player == (0, 1)  # off the board: stays
    env.player = (0, 0)
    for move in ("down", "down", "right"):
        result = env.step(f"I go {move}")
        assert not result.done and result.reward == 0.0
    picture = result.observation.images[0]
    assert picture.getpixel((CELL + CELL // 2, 2 * CELL + CELL // 2)) == (210, 30, 30)
    final = env.step("right")
    assert final.done and final.reward == 1.0 and final.info == {"solved": 1}


def test_an_answer_without_a_move_is_asked_again() -> None:
    env = MazeEnv()
    env.reset({"seed": 3})
    result = env.step("I am not sure")
    assert result.observation is not None and "up, down, left or right" in result.observation.text
    assert result.info == {"invalid": 1} and not result.done
