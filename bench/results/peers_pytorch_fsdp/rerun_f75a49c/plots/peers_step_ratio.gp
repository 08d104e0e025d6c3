set terminal pngcairo noenhanced size 1000,560 font 'DejaVu Sans,10'
set output '../peers_step_ratio.png'
set title 'Step time / PyTorch DDP (median of interleaved runs; lower is faster)'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set key below
set ylabel 'step time / DDP'
set yrange [0:*]
set grid ytics
plot for [i=2:15] 'peers_step_ratio.dat' using i:xtic(1) title columnhead(i), 1 with lines lc 'black' dt 2 notitle
