"""Short stories and fables, written for this corpus."""

TEXT = """\
The Tortoise and the Hare

A hare once laughed at a tortoise for being slow. "Do you ever get anywhere?" he asked with a grin.
"Yes," said the tortoise, "and I get there sooner than you think. I will race you and prove it."
The hare was much amused at the idea of running a race with the tortoise, but for the fun of the
thing he agreed. So the fox, who had consented to act as judge, marked the distance and started
the runners off. The hare was soon far out of sight, and to make the tortoise feel how silly it
was to try a race with a hare, he lay down beside the course to take a nap until the tortoise
should catch up. The tortoise meanwhile kept going slowly but steadily, and after a time passed
the place where the hare was sleeping. The hare slept on very peacefully, and when at last he did
wake up, the tortoise was near the goal. The hare now ran his swiftest, but he could not overtake
the tortoise in time. Slow and steady wins the race.

The Lighthouse Keeper

Every evening at half past six, Margaret climbed the one hundred and twelve steps of the old
lighthouse. She counted them out loud, the way her father had, and the way his mother had before
him. At the top she wiped the great lens with a soft cloth, trimmed the wick, and checked the oil.
Then she sat by the window with a cup of tea and watched the ships come home. Some nights the sea
was calm and silver; other nights the wind threw rain against the glass so hard that the whole
tower seemed to hum. She never minded the storms. "A light is only useful in the dark," she liked
to say, and she said it to anyone who asked why she stayed.

One winter a young man from the harbour office came to tell her that the light would soon be run
by a machine. "You won't have to climb the stairs anymore," he said, as if it were good news.
Margaret thanked him, poured him a cup of tea, and asked him to stay until the ships came in. He
stayed. He watched the beam sweep across the water, and he watched her watching it. When the last
fishing boat rounded the point and blinked its lamp twice, she blinked the lantern back. "They
like to know someone saw them," she said. The young man wrote something in his notebook, and the
machine, for reasons nobody at the office could quite explain, was delayed for another ten years.

The Clockmaker's Apprentice

In a narrow street of a busy town there was a shop full of clocks. Tall clocks stood against the
walls like soldiers, small clocks sat on the shelves like birds, and on the counter a brass clock
with a glass face showed all of its wheels turning at once. The clockmaker was an old woman with
quick hands and patient eyes. Her apprentice, a boy named Tomas, wanted to learn everything at
once. "Teach me how to build the tallest clock," he begged on his first day.

"First," she said, "you will learn to listen." She handed him a small broken watch and a pair of
tweezers. For a week he did nothing but open watches, listen to them, and close them again. He
learned that a healthy watch ticks evenly, like a calm heart, and that a sick one stutters, drags,
or races. In the second week he learned to clean the tiny gears with a brush made of a single
hair. In the third week he learned to oil the pivots with a drop so small he could barely see it.
By the end of the year he could tell, just by listening, which of the hundred clocks in the shop
was running two seconds slow.

"Now," said the old woman, "you may build the tall clock." And he did, and it kept perfect time,
and every evening when the shop was quiet he stood beside it and listened, because that was where
all of it had begun.

The Fox and the Grapes

One hot summer afternoon a fox was strolling through an orchard until he came to a bunch of grapes
just ripening on a vine which had been trained over a lofty branch. "Just the thing to quench my
thirst," said he. Drawing back a few paces, he took a run and a jump, and just missed the bunch.
Turning round again with a one, two, three, he jumped up, but with no greater success. Again and
again he tried after the tempting morsel, but at last had to give it up, and walked away with his
nose in the air, saying: "I am sure they are sour." It is easy to despise what you cannot get.

A Walk in the Rain

It had been raining since breakfast, and by noon the children were restless. Their grandfather
looked out at the grey sky, then at the four bored faces around the kitchen table. "Boots," he
announced. "Coats. Hats. We are going for a walk." Nobody believed him at first. But ten minutes
later they were all outside, splashing through puddles, watching the water race along the gutters
and disappear into the drains with a gurgle. They found a snail crossing the path and stopped to
let it pass. They found a spider's web strung with drops like a necklace. They found that the
woods smelled different in the rain: greener, older, and somehow closer. When they came home,
soaked and laughing, their grandmother had made hot chocolate. Years later, when the children had
grown up and had children of their own, that was the day they remembered best.

The Two Travelers

Two travelers were walking along a mountain road when they saw a bear coming toward them. One of
them climbed quickly into a tree and hid among the branches. The other, seeing that he would be
caught, fell flat on the ground. The bear came up, sniffed at him, and put its muzzle close to his
ear; but the man held his breath and lay as still as he could, for it is said that a bear will not
touch a dead body. When the bear had gone, the other traveler came down from the tree and asked,
with a laugh, what the bear had whispered in his ear. "It told me," said his companion, "never to
travel with a friend who leaves you at the first sign of danger."

The Garden at the End of the Street

Nobody on Maple Street could remember who had planted the garden at the end of the road. It had
simply always been there: a small square of earth behind a low stone wall, with a wooden gate that
never quite closed. In spring it filled with tulips, red and yellow and a purple so dark it looked
almost black. In summer there were tomatoes, beans climbing up bamboo poles, and sunflowers taller
than the postman. In autumn the pumpkins appeared, fat and orange, and in winter the bare branches
of an apple tree held the snow like cupped hands.

The neighbours took turns looking after it without ever agreeing to. Mrs. Okafor watered it on
Mondays and Thursdays. The twins from number fourteen pulled weeds whenever their mother told them
to go outside and play. Mr. Lindqvist, who was eighty-one and walked with a cane, sat on the bench
by the gate every morning and told the sparrows the news. When a developer came with plans for a
parking lot, the whole street turned up at the town meeting. The plans were withdrawn. The garden
is still there, and if you visit in June you can take a handful of beans home with you, as long as
you promise to bring a seed back in the spring.

The Boy Who Cried Wolf

There was once a young shepherd boy who tended his sheep at the foot of a mountain near a dark
forest. It was rather lonely for him all day, so he thought of a plan by which he could get a
little company and some excitement. He rushed down towards the village calling out "Wolf, Wolf,"
and the villagers came out to meet him, and some of them stopped with him for a considerable time.
This pleased the boy so much that a few days afterwards he tried the same trick, and again the
villagers came to his help. But shortly after this a wolf actually did come out from the forest,
and began to worry the sheep, and the boy of course cried out "Wolf, Wolf," still louder than
before. But this time the villagers, who had been fooled twice before, thought that the boy was
again deceiving them, and nobody stirred to come to his help. A liar will not be believed, even
when he speaks the truth.
"""
