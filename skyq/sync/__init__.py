"""Weight sync: plan -> serialize -> bucket -> transport -> receive -> verify -> commit.

The trainer side (`sender.WeightSender`) quantizes with the precision's strategy, packs a weight and
its scales into the same bucket, and ships a JSON manifest (or, when the layout is that of the last
committed sync, a short same-layout message: layout.py) then raw bucket bytes over a transport.
The engine side (`receiver.WeightReceiver`) accounts for every tensor against the plan and commits
the new weight version only when everything matched. Nothing here imports model code.
"""
