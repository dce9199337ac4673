"""The searching demonstrator: its rules on written transcripts, and wins on real games that it
plays from the observation text alone (the same texts give the same actions, with no game)."""

from __future__ import annotations

import pytest

from envs.alfworld.search_expert import SearchExpert, parse_goal

ROOM = (
    "You are in the middle of a room. Looking quickly around you, you see a desk 1, a drawer 2, "
    "a drawer 1, a shelf 1, and a sidetable 1.\n\n"
)


def play_transcript(expert: SearchExpert, replies: list[str]) -> list[str]:
    """The expert's actions when the game answers each one with the next reply."""
    actions = []
    for reply in replies:
        actions.append(expert.act())
        expert.observe(reply)
    actions.append(expert.act())
    return actions


def test_parse_goal_reads_the_four_goal_sentences():
    assert parse_goal("Your task is to: look at alarmclock under the desklamp.") == (
        "look",
        "alarmclock",
        "desklamp",
    )
    assert parse_goal("Your task is to: examine the cd with the desklamp.") == (
        "look",
        "cd",
        "desklamp",
    )
    assert parse_goal("Your task is to: put some pillow on armchair.") == (
        "place",
        "pillow",
        "armchair",
    )
    assert parse_goal("Your task is to: put a pen in drawer.") == ("place", "pen", "drawer")
    assert parse_goal("Your task is to: heat some egg and put it in garbagecan.") is None


def test_place_searches_in_listed_order_opens_closed_and_skips_the_goal_class():
    goal = "Your task is to: put a pen in shelf."
    expert = SearchExpert(ROOM + goal)
    actions = play_transcript(
        expert,
        [
            "You arrive at desk 1. On the desk 1, you see a book 1, and a pencil 3.",
            "You arrive at drawer 2. The drawer 2 is closed.",
            "You open the drawer 2. The drawer 2 is open. In it, you see nothing.",
            "Nothing happens.",  # drawer 1 shares drawer 2's spot: the agent is there.
            "The drawer 1 is closed.",
            "You open the drawer 1. The drawer 1 is open. In it, you see a pen 2.",
            "You pick up the pen 2 from the drawer 1.",
            "You arrive at shelf 1. On the shelf 1, you see a vase 1.",
            "You move the pen 2 to the shelf 1.",
        ],
    )
    assert actions == [
        "go to desk 1",
        "go to drawer 2",
        "open drawer 2",
        "go to drawer 1",
        "examine drawer 1",
        "open drawer 1",
        "take pen 2 from drawer 1",
        "go to shelf 1",  # The shelf was never searched: it cannot already hold the pen.
        "move pen 2 to shelf 1",
        None,  # Done: it does not take the pen back.
    ]


def test_look_returns_to_a_lamp_it_saw_and_gives_up_when_nothing_is_left():
    expert = SearchExpert(ROOM, goal="Your task is to: look at cd under the desklamp.")
    actions = play_transcript(
        expert,
        [
            "You arrive at desk 1. On the desk 1, you see a desklamp 1, and a pencil 3.",
            "You arrive at drawer 2. On the drawer 2, you see a cd 1.",
            "You pick up the cd 1 from the drawer 2.",
            "You arrive at desk 1. On the desk 1, you see a desklamp 1, and a pencil 3.",
        ],
    )
    assert actions == [
        "go to desk 1",
        "go to drawer 2",
        "take cd 1 from drawer 2",
        "go to desk 1",
        "use desklamp 1",
    ]
    expert.observe("You turn on the desklamp 1.")
    assert expert.act() is None
    lost = SearchExpert(ROOM, goal="Your task is to: look at cd under the desklamp.")
    replies = [f"You arrive at {r}. On the {r}, you see nothing." for r in lost.receptacles]
    actions = play_transcript(lost, replies)
    assert actions == [f"go to {r}" for r in lost.receptacles] + [None]
    assert SearchExpert(ROOM, goal="Your task is to: heat some egg.").act() is None


def test_an_action_the_game_refuses_is_not_repeated():
    expert = SearchExpert(ROOM, goal="Your task is to: put a pen in shelf.")
    assert expert.act() == "go to desk 1"
    expert.observe("You arrive at desk 1. On the desk 1, you see a pen 1, and a pen 2.")
    assert expert.act() == "take pen 1 from desk 1"
    expert.observe("Nothing happens.")
    assert expert.act() == "take pen 2 from desk 1"


@pytest.fixture(scope="module")
def played():
    """The searching demonstrator's episodes on four real training games (both task types)."""
    from bpo_jax.agent.demos import play_search
    from envs.alfworld import load_tasks
    from envs.sandbox import SandboxPool

    tasks = load_tasks(None, "train", ["look_at_obj_in_light"])[:2]
    tasks += load_tasks(None, "train", ["pick_and_place_simple"])[-2:]
    kwargs = {"max_steps": 60, "strip_welcome": True}
    with SandboxPool("alfworld", kwargs, backend="fork", num_workers=2) as pool:
        return tasks, play_search(pool, tasks, "alfworld")


def test_search_wins_real_games(played):
    tasks, demos = played
    assert [d["task_id"] for d in demos] == [t.task_id for t in tasks]
    assert all(d["won"] for d in demos), [(d["task_id"], d["actions"]) for d in demos]
    for task, demo in zip(tasks, demos):
        # It searched: never shorter than the planner's plan, which knows where things are.
        assert len(demo["actions"]) >= len(task.walkthrough)
        assert demo["actions"][0].startswith("go to ")


def test_search_decides_from_the_observation_text_only(played, monkeypatch):
    """Replayed offline, with no game, task or data root, the same texts give the same actions;
    an edited text (the target object not shown) gives a different one."""
    monkeypatch.setenv("ALFWORLD_DATA", "/nonexistent")
    _, demos = played
    for demo in demos:
        expert = SearchExpert(demo["first_obs"], demo["goal"])
        for action, observation in zip(demo["actions"], demo["observations"]):
            assert expert.act() == action
            expert.observe(observation)
        take = next(i for i, a in enumerate(demo["actions"]) if a.startswith("take "))
        obj = demo["actions"][take].split(" from ")[0][len("take ") :]
        blind = SearchExpert(demo["first_obs"], demo["goal"])
        for action, observation in zip(demo["actions"][:take], demo["observations"][:take]):
            assert blind.act() == action
            blind.observe(observation.replace(f"a {obj}", "a vase 99"))
        assert blind.act() != demo["actions"][take]


def test_the_agents_notes_hold_the_demonstrators_memory(played):
    """At every step of the real games, the tiny agent's notes (`agent.notes`) render exactly
    the memory the demonstrator decides from: a policy cloned with notes sees that state."""
    from bpo_jax.agent import EpisodeText
    from envs.alfworld.memory import notes

    _, demos = played
    for demo in demos:
        expert = SearchExpert(demo["first_obs"], demo["goal"])
        ep = EpisodeText.start(demo["first_obs"], goal=demo["goal"])
        for action, observation in zip(demo["actions"], demo["observations"]):
            assert notes(ep) == expert.memory.render()
            assert expert.act() == action
            expert.observe(observation)
            ep.record(action, observation)
        assert notes(ep) == expert.memory.render()
