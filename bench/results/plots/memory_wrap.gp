set terminal pngcairo noenhanced size 1000,560 font 'DejaVu Sans,10'
set output '../memory_wrap.png'
set title 'FULL_SHARD per-rank model state at peak (formula, stacked; points: measured) and step time'
set style data histograms
set style histogram rowstacked
set style fill solid 0.7 border -1
set boxwidth 0.6
set key outside right top
set ylabel 'MiB per rank'
set y2label 'step time (ms)'
set yrange [0:*]
set y2range [0:*]
set ytics nomirror
set y2tics
set grid ytics
plot 'memory_wrap.dat' using 2:xtic(1) title 'parameters peak', '' using 3 title 'gradients peak', \
     '' using 4 title 'AdamW state', \
     '' using 0:5 with points pt 7 ps 2 lc 'black' title 'measured total', \
     '' using 0:7 axes x1y2 with linespoints pt 5 lw 2 lc 'red' title 'step time (right axis)'
